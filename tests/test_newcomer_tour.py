"""Issue 41 point 11: the README tour runs as written. Its commands are read from README.md's tour block:
every ``mariana`` command parses with the real parser and resolves its config (`check_command`: the flags
a command would refuse, e.g. an inert one, fail here too), every file or folder a command names exists or
is made by an earlier tour command (``--out``, ``mkdir``, ``tar -C``, ``cp``), a stream stops by itself
(``--idle-exit``), ASR gets a dev set to validate on, and the cheap commands (``--help``, the shell steps
that make the inputs) are run. Training runs are too slow for the suite."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from cliwalk import run_main

ROOT = Path(__file__).resolve().parents[1]


def tour() -> list[list[str]]:
    """The tour's commands in order, as argv lists (continuations joined, comments and ``&`` dropped;
    ``a && b`` gives two)."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## A tour of the `mariana` command", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    joined = re.sub(r"\\\n\s*(#.*\n\s*)?", " ", block)
    commands = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]  # an environment variable set for the command (MLFLOW_TRACKING_URI=...)
        while words:
            cut = next((i for i, w in enumerate(words) if w in ("&&", "&", ";")), len(words))
            if words[:cut]:
                commands.append(words[:cut])
            words = words[cut + 1 :]
    return commands


def _made_by(argv: list[str]) -> list[str]:
    """Paths a tour command makes: a mariana command's --out/--home/--tensorboard, mkdir's folders, tar
    -C's members, cp's target."""
    tool = argv[0]
    if tool == "mariana":
        return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--out", "--home", "--tensorboard")]
    if tool == "mkdir":
        return [a for a in argv[1:] if not a.startswith("-")]
    if tool == "tar":
        where = argv[argv.index("-C") + 1]
        members = [a for a in argv[argv.index("-C") + 2 :] if not a.startswith("-")]
        return [f"{where}/{m}" for m in members]
    if tool == "cp":
        return [argv[-1]]
    if tool == "curl":  # a request to the server an earlier command started
        return []
    raise AssertionError(f"the tour runs {tool}: teach this test what it makes")


def _named_paths(argv: list[str]) -> list[str]:
    """The words of a command that name files or folders it reads (a relative path with a '/' or a file
    name with an extension, e.g. ``a.jpg``)."""
    made = set(_made_by(argv))
    named = [w for w in argv if "/" in w or re.search(r"\.[a-z]{2,7}$", w)]
    outs = [w for w in named if not w.startswith(("-", "http")) and w not in made]
    if argv[0] == "tar":
        return [argv[argv.index("-xf") + 1]]
    return outs


def test_every_tour_command_parses_and_names_files_that_exist_or_are_made_first(tmp_path):
    """Each ``mariana`` command is checked as `mariana submit` checks it (`check_command`), in a scratch
    folder whose ``../shared`` is the real one and where what earlier commands make exists (the shell steps
    run, a training command's ``--out`` is an empty folder)."""
    from mariana.platform.cli.main import check_command

    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "shared").symlink_to((ROOT / ".." / "shared").resolve())
    made: list[str] = []
    commands = tour()
    assert len([c for c in commands if c[0] == "mariana"]) >= 14, commands
    for argv in commands:
        for path in _named_paths(argv):
            ok = (ROOT / path).exists() or any(
                path == m or path.startswith(m.rstrip("/") + "/") for m in made
            )
            assert ok, (
                f"`{shlex.join(argv)}` names {path}, which neither exists nor is made by an earlier command"
            )
        if argv[0] == "mariana" and "--help" not in argv:
            check_command(argv[1:], cwd=work)  # SystemExit (argparse) or MarianaError fails the test
        elif argv[0] in ("mkdir", "tar", "cp"):
            subprocess.run(argv, cwd=work, check=True, timeout=60)
        for path in _made_by(argv) if argv[0] == "mariana" else ():
            (work / path).mkdir(parents=True, exist_ok=True)
        made += _made_by(argv)


def test_the_tour_stream_stops_and_asr_gets_a_dev_set():
    commands = tour()
    stream = next(c for c in commands if c[:3] == ["mariana", "pctr", "stream"])
    assert "--idle-exit" in stream and float(stream[stream.index("--idle-exit") + 1]) > 0, stream
    prepare = next(c for c in commands if c[:3] == ["mariana", "asr", "prepare"])
    assert "--dev-speakers" in prepare, prepare


def test_the_cheap_tour_commands_run(tmp_path, capsys):
    """``--help`` in process; the shell steps that make the tour's inputs in a scratch folder whose
    ``../shared`` is the real one (a training command is not run: only its output's parent folder is
    made, as it would have been)."""
    (tmp_path / "work").mkdir()
    (tmp_path / "shared").symlink_to((ROOT / ".." / "shared").resolve())
    for argv in tour():
        if argv[0] == "mariana" and "--help" in argv:
            rc, out, _ = run_main(argv[1:], capsys)
            assert rc == 0 and "usage: mariana" in out
        elif argv[0] == "mariana":  # not run here: only the folder its output goes into (runs/)
            for made in _made_by(argv):
                (tmp_path / "work" / made).parent.mkdir(parents=True, exist_ok=True)
        elif argv[0] != "mariana" and argv[0] != "curl":  # curl needs the server the tour started
            subprocess.run(argv, cwd=tmp_path / "work", check=True, timeout=60)
            for made in _made_by(argv):
                assert (tmp_path / "work" / made).exists(), made
