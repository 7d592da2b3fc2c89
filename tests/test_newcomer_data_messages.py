"""Issue 41 points 7 and 12 (data and folder messages): an empty data file is named as empty (not "use a
smaller --batch-size"), an ASR data dir without training utterances says so (not "prepare more
utterances"), generated over every app's training reader; no log line reads ``(None tier)``; every command
a folder refusal names exists (generated over every marked output flag of every command)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from cliwalk import leaf_parsers, run_main


def _asr_test_only(tmp: Path) -> Path:
    """What `asr prepare --test-speakers` leaves for one new speaker: no training utterance."""
    for split in ("train", "dev", "test"):
        (tmp / split).mkdir(parents=True)
        for name in ("wav.scp", "text", "utt2spk"):
            (tmp / split / name).write_text("" if split != "test" else f"u1 {name}\n")
    return tmp


EMPTY = {  # app reader -> (its --data, made empty, and the flags it needs; what the message must say)
    "pctr criteo": (lambda t: (t / "day.tsv", ["--format", "criteo"]), "empty file"),
    "pctr libfm": (lambda t: (t / "day.libfm", ["--format", "libfm"]), "empty file"),
    "pctr folder": (lambda t: (t / "days", ["--format", "criteo"]), "every file is empty"),
    "mlp libfm": (lambda t: (t / "rows.libfm", []), "empty file"),
    "vision tar": (lambda t: (t / "train.tar", []), "empty file"),
    "asr test-only dir": (lambda t: (_asr_test_only(t / "theo-data"), []), "lists no utterances"),
}


def test_every_app_with_a_reader_is_covered():
    trained = {path[0] for path, _ in leaf_parsers() if path[1:] == ("train",)}
    assert trained <= {case.split()[0] for case in EMPTY}, trained


@pytest.mark.parametrize("case", sorted(EMPTY))
def test_an_empty_input_is_named_as_empty(tmp_path: Path, case: str, capsys):
    make, says = EMPTY[case]
    data, flags = make(tmp_path)
    if case == "pctr folder":
        data.mkdir()
        for day in ("day-01.tsv", "day-02.tsv"):
            (data / day).touch()
    elif not data.exists():
        data.touch()
    app = case.split()[0]
    argv = [app, "train", "--data", data, "--out", tmp_path / "run", "--preset", "debug", *flags]
    rc, _, err = run_main(argv, capsys)
    assert rc == 2 and says in err and "--batch-size" not in err and "more" not in err, err
    assert str(data) in err, err


def test_no_log_line_names_a_none_tier(tmp_path: Path, caplog):
    from mariana.apps.pctr.data.encoding import Encoder, infer_schema
    from mariana.apps.pctr.data.reader import WorkerData
    from mariana.platform.core.errors import DataError

    bad = tmp_path / "bad.libfm"
    bad.write_text("not a row\n" * 8)
    encoder = Encoder(infer_schema(bad, "libfm", 100, num_fields=3))
    data = WorkerData(bad, encoder, 0, 8, batch_size=2)
    with caplog.at_level(logging.INFO, logger="mariana"), pytest.raises(DataError, match="no valid rows"):
        list(data.batches(0))
    assert "None tier" not in caplog.text, caplog.text


OUTPUTS = sorted(
    {
        (path, flag, kind, reuse)
        for path, parser in leaf_parsers()
        for flag, kind, reuse in (parser.get_default("_outputs") or {}).values()
    }
)


@pytest.mark.parametrize("path,flag,kind,reuse", OUTPUTS, ids=[f"{' '.join(o[0])} {o[1]}" for o in OUTPUTS])
def test_every_command_a_folder_refusal_names_exists(tmp_path: Path, path, flag, kind, reuse):
    """A user's folder, and a folder another output kind marked: the refusal names only real commands."""
    from mariana.platform.cli.outputs import MARKER, guard_output
    from mariana.platform.core.errors import MarianaError

    commands = {" ".join(p) for p, _ in leaf_parsers()}
    user, other = tmp_path / "user", tmp_path / "other"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    other.mkdir()
    stranger = next(k for _, _, k, _ in OUTPUTS if k != kind)
    (other / MARKER).write_text(f'{{"command": "{stranger}"}}\n')
    (other / "made.json").write_text("{}")
    for folder in (user, other):
        with pytest.raises(MarianaError) as e:
            guard_output(str(folder), flag, kind, reuse, False, create=False)
        named = re.findall(r"`mariana ([a-z -]+?)`", str(e.value))
        assert named and all(n in commands for n in named), str(e.value)
