"""Issue 30.2: no command writes into data it did not create without ``--force``. Generated from the
parser: every flag marked as an output (`mariana.platform.cli.outputs.mark_output`), pointed at a folder
holding someone else's file, is refused in one line (exit 2) naming --force, and the file and folder are
left as they were; every flag that looks like an output is marked (or listed here with why it is not).
The marker rules themselves (own output continued or refused per command, --force) on the real commands."""

import argparse
import re

import pytest
from cliwalk import leaf_parsers, run_main
from mariana.platform.cli.outputs import MARKER


def output_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions of ``parser`` marked by `mark_output` (which sets their ``output``)."""
    return [a for a in parser._actions if getattr(a, "output", None)]


OUTPUTS = [(path, a) for path, p in leaf_parsers() for a in output_actions(p)]
# flags that name a path written into but are not guarded, with why
EXEMPT = {
    (
        "jobs",
        "serve",
        "--home",
    ): "the service's own state folder (jobs.db, runs/job-ID): opened and continued",
}


def _looks_like_output(a: argparse.Action) -> bool:
    """A flag named like a folder written into (--out, --*-dir, --*cache, --home) that takes a free value."""
    names = " ".join(a.option_strings)
    return (
        bool(re.search(r"--(out|home|[\w-]*cache|[\w-]*-dir)( |$)", names))
        and a.choices is None
        and a.nargs != 0
    )


def test_every_output_looking_flag_is_guarded():
    unmarked = [
        (*path, a.option_strings[0])
        for path, p in leaf_parsers()
        for a in p._actions
        if _looks_like_output(a) and not getattr(a, "output", None)
    ]
    assert sorted(set(unmarked) - set(EXEMPT)) == [], "an output flag without mark_output"
    assert len(OUTPUTS) >= 12


def _required_argv(parser: argparse.ArgumentParser, placeholder) -> list[str]:
    """The parser's required options and positionals with placeholder values (first choice if any)."""
    argv = []
    for a in parser._actions:
        if a.required and a.option_strings and not getattr(a, "output", None):
            argv += [a.option_strings[0], a.choices[0] if a.choices else placeholder]
        elif not a.option_strings and a.nargs not in ("*", "?", argparse.REMAINDER, argparse.SUPPRESS):
            if not isinstance(a, argparse._SubParsersAction):
                argv.append(sorted(a.choices)[0] if a.choices else placeholder)
    return [str(x) for x in argv]


@pytest.mark.parametrize(
    "path,action", OUTPUTS, ids=[" ".join(p) + " " + a.option_strings[0] for p, a in OUTPUTS]
)
def test_output_flag_refuses_foreign_data(path, action, tmp_path, capsys):
    parser = dict(leaf_parsers())[path]
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "precious.txt").write_text("the user's\n")
    placeholder = tmp_path / "placeholder.txt"
    placeholder.write_text("1 0:1\n")
    argv = [*path, *_required_argv(parser, placeholder), action.option_strings[0], theirs]
    if any("--data" in a.option_strings and not a.required for a in parser._actions):
        argv += ["--data", tmp_path if path[-1] == "stream" else placeholder]  # a stream follows a folder
    rc, out, err = run_main(argv, capsys)
    assert rc == 2 and "--force" in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert sorted(x.name for x in theirs.iterdir()) == ["precious.txt"]
    assert (theirs / "precious.txt").read_text() == "the user's\n"


def test_own_output_rules(tmp_path, capsys):
    """Re-running into its own output: refused where it would replace it (drift-logs), unless --force."""
    days = tmp_path / "days"
    argv = ["pctr", "drift-logs", "--out", days, "--days", "1", "--rows-per-day", "20"]
    assert run_main(argv, capsys)[0] == 0
    assert (days / MARKER).is_file()
    rc, out, err = run_main(argv, capsys)
    assert rc == 2 and "earlier `mariana pctr drift-logs`" in err and "--force" in err, err
    assert run_main([*argv, "--force"], capsys)[0] == 0
    # another command's output is not this command's: an ASR prepare into the day files is refused
    rc, out, err = run_main(["asr", "prepare", "--data", days, "--out", days], capsys)
    assert rc == 2 and "--force" in err, err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, data_dir):
    p = tmp_path_factory.mktemp("outputs") / "f.libfm"
    lines = (data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines()[:200]
    p.write_text("\n".join(lines) + "\n")
    return p


def _pctr(data, run, *extra):
    return ["pctr", "train", "--data", data, "--out", run, "--preset", "debug", "--batch-size", "16"] + [
        "--max-steps",
        "2",
        "--no-progress",
        *extra,
    ]


def test_finished_run_needs_resume_or_force(tiny, tmp_path, capsys):
    run = tmp_path / "run"
    assert run_main(_pctr(tiny, run), capsys)[0] == 0
    rc, out, err = run_main(_pctr(tiny, run), capsys)
    assert rc == 2 and "already holds a trained run" in err and "--force" in err, err
    (run / "metrics.jsonl").write_text('{"step": 999}\n')
    rc, out, err = run_main(_pctr(tiny, run, "--force"), capsys)
    assert rc == 0, err
    assert '"step": 999' not in (run / "metrics.jsonl").read_text()  # a new run, not appended to the old


def test_run_interrupted_before_its_first_checkpoint_starts_again(tiny, tmp_path, capsys):
    """Issue 30.9: Ctrl-C (or `jobs cancel`) after the first export but before any checkpoint leaves a
    model, logs and metrics.jsonl but no checkpoint and no metrics.json: the same command starts it again
    (it used to say "already holds a trained run; pass --resume", and --resume "no checkpoint")."""
    run = tmp_path / "run"
    assert run_main(_pctr(tiny, run), capsys)[0] == 0
    import shutil

    shutil.rmtree(run / "checkpoints")  # the state an interrupted run leaves
    (run / "metrics.json").unlink()
    rc, out, err = run_main(_pctr(tiny, run, "--resume"), capsys)
    assert rc == 2 and "without --resume to start it again" in err, err
    rc, out, err = run_main(_pctr(tiny, run), capsys)
    assert rc == 0, err
    assert (run / "checkpoints" / "latest").is_file() and (run / "metrics.json").is_file()
