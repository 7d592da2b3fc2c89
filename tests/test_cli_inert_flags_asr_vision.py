"""Issue 30.3 for asr, vision and serve: a flag that would change nothing is refused (exit 2, one line
naming it and what it needs), not silently ignored. The flags documented as "unused" are gone; flags of
the non-config commands that apply only with another one are refused without it (in-process, before any
data is read or written)."""

from __future__ import annotations

import pytest
from cliwalk import leaf_parsers, option, run_main

FSDD = "../shared/data/fsdd/recordings"


@pytest.mark.parametrize(
    "command", [("asr", "synth"), ("asr", "transcribe"), ("vision", "classify"), ("serve",)], ids=" ".join
)
def test_unused_data_flags_are_gone(command):
    parser = dict(leaf_parsers())[command]
    assert option(parser, "--data") is None, f"mariana {' '.join(command)} still takes an unused --data"


def test_unused_data_flag_is_refused_by_the_parser(tmp_path, capsys):
    rc, _, err = run_main(["vision", "classify", "--model", tmp_path, "--data", tmp_path, "x.jpg"], capsys)
    assert rc == 2 and "unrecognized arguments: --data" in err


@pytest.mark.parametrize(
    "argv,needs",
    [
        (["asr", "prepare", "--data", FSDD, "--out", "{tmp}/p", "--synth-ratio", "2"], "--synth-ratio applies to runs with --synth"),
        (["serve", "--pctr", "{tmp}/run", "--watch-interval", "0.5"], "--watch-interval applies to --watch"),
    ],
    ids=["asr prepare --synth-ratio", "serve --watch-interval"],
)  # fmt: skip
def test_flag_without_the_flag_it_needs_is_refused(argv, needs, tmp_path, capsys):
    rc, out, err = run_main([a.format(tmp=tmp_path) for a in argv], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("mariana: error: ") and needs in lines[0], err
    assert not (tmp_path / "p").exists(), "refused before anything was written"


def test_synth_ratio_applies_with_synth(tmp_path, capsys):
    """--synth-ratio with --synth gets past that check (to the missing synth folder's own error)."""
    rc, _, err = run_main(
        [
            "asr",
            "prepare",
            "--data",
            FSDD,
            "--out",
            tmp_path / "p",
            "--synth",
            tmp_path / "none",
            "--synth-ratio",
            "2",
        ],
        capsys,
    )
    assert rc == 2 and "--synth-ratio" not in err and "none" in err
