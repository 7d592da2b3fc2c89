"""Issue 30.7: a warm start whose training never beats its source exports the source model unchanged
(early stopping keeps the best: the step-0 evaluation of the source); the last line says so, and pCTR
names its incremental recipe. Generated over the train commands with --init-from (mlp stands for the
apps that share `run_training`: asr, vision)."""

import pytest
from cliwalk import leaf_parsers, option, run_main

ROWS = 300


@pytest.fixture(scope="module")
def data(tmp_path_factory, data_dir):
    p = tmp_path_factory.mktemp("warm") / "f.libfm"
    lines = (data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines()[:ROWS]
    p.write_text("\n".join(lines) + "\n")
    return p


def _argv(app, data, out, *extra):
    base = [app, "train", "--data", data, "--out", out, "--preset", "debug", "--batch-size", "32"]
    return [*base, "--no-progress", "--max-steps", "2", *extra]


# a warm start that cannot learn: every learning rate 0
FROZEN = {
    "pctr": ["--lr", "0", "--sparse-lr", "0", "--eval-every", "1"],
    "mlp": ["--lr", "0", "--eval-every", "1"],
}
WARM = [p for p, parser in leaf_parsers() if p[-1] == "train" and option(parser, "--init-from")]


def test_every_warm_start_command_is_covered():
    assert {p[0] for p in WARM} - set(FROZEN) <= {"asr", "vision"}  # they share mlp's run_training


@pytest.mark.parametrize("app", sorted(FROZEN))
def test_unchanged_warm_start_is_said(app, data, tmp_path, capsys):
    src = tmp_path / "src"
    rc, out, err = run_main(_argv(app, data, src), capsys)
    assert rc == 0, err
    assert "unchanged" not in out
    rc, out, err = run_main(_argv(app, data, tmp_path / "warm", "--init-from", src, *FROZEN[app]), capsys)
    assert rc == 0, err
    last = out.strip().splitlines()[-1]
    assert "no step beat the --init-from model" in last and f"{src} unchanged" in last, out
    if app == "pctr":
        assert "--init-train-state --split 1,0,0 --epochs 1" in last
