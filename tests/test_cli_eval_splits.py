"""Issue 30.1: every ``eval --split`` scores the rows the run's own split gave that name (the fractions
come from RUN/config.toml, not the eval command's defaults), and a split the run does not have is refused
(one line, exit 2). Generated over the parser: every eval command with a ``--split`` flag must have a
recipe below, so a new one cannot be left out."""

import json

import pytest
from cliwalk import leaf_parsers, option, run_main

ROWS = 400


@pytest.fixture(scope="module")
def libfm(tmp_path_factory, data_dir):
    p = tmp_path_factory.mktemp("splits") / "f400.libfm"
    lines = (data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines()[:ROWS]
    p.write_text("\n".join(lines) + "\n")
    return p


def _pctr_train(data, out, split):
    tr, va, te = split
    return (
        ["pctr", "train", "--data", data, "--out", out, "--preset", "debug", "--max-steps", "1"]
        + [
            "--batch-size",
            "16",
            "--split",
            f"{tr},{va},{te}",
            "--no-progress",
        ]
        + (["--early-stop", "0"] if float(va) > 0 else [])
    )  # without validation rows the flag is refused (inert)


def _mlp_train(data, out, split):
    tr, va, te = split
    return ["mlp", "train", "--data", data, "--out", out, "--preset", "debug", "--max-steps", "1"] + [
        "--batch-size",
        "16",
        "--val-fraction",
        str(va),
        "--test-fraction",
        str(te),
        "--no-progress",
    ]


# eval command -> (its training command given (data, out, (train, val, test) fractions), fractions of a
# run without some split, the splits that run lacks). pCTR: the day-partition recipe --split 1,0,0.
RECIPES = {
    ("pctr", "eval"): (_pctr_train, (1.0, 0.0, 0.0), ("val", "test")),
    ("mlp", "eval"): (_mlp_train, (0.8, 0.2, 0.0), ("test",)),
}
EVALS = [path for path, p in leaf_parsers() if path[-1] == "eval" and option(p, "--split")]


def test_every_split_eval_has_a_recipe():
    assert sorted(EVALS) == sorted(RECIPES), "an eval command with --split has no recipe here"


@pytest.mark.parametrize("cmd", sorted(RECIPES), ids=" ".join)
def test_eval_uses_the_runs_split(cmd, libfm, tmp_path, capsys):
    run = tmp_path / "run"
    train, lacking, missing = RECIPES[cmd]
    rc, out, err = run_main(train(libfm, run, (0.5, 0.3, 0.2)), capsys)
    assert rc == 0, err
    for split, rows in (("val", 120), ("test", 80)):
        rc, out, err = run_main([*cmd, "--model", run, "--data", libfm, "--split", split], capsys)
        assert rc == 0, err
        name = libfm.stem + f"-{split}.json"
        assert json.loads((run / "eval" / name).read_text())["rows"] == rows, (split, out)
    # a run without a test (or val) split: that split is refused, not scored from the run's training rows
    whole = tmp_path / "whole"
    rc, out, err = run_main(train(libfm, whole, lacking), capsys)
    assert rc == 0, err
    for split in missing:
        rc, out, err = run_main([*cmd, "--model", whole, "--data", libfm, "--split", split], capsys)
        assert rc == 2 and "mariana: error:" in err and len(err.strip().splitlines()) == 1, (split, err)
        assert not (whole / "eval" / f"{libfm.stem}-{split}.json").exists()
