"""`mariana pctr train` (one process) -> `mariana pctr eval` -> the serving Predictor, end to end."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from helpers import last_line, run_cli
from mariana.apps.pctr.predict import load_predictor

pytestmark = pytest.mark.slow


def test_train_eval_predict_roundtrip(data_dir, tmp_path):
    frappe = data_dir / "frappe" / "frappe.validation.libfm"
    run = tmp_path / "fm"
    p = run_cli(
        ["pctr", "train", "--data", frappe, "--format", "libfm", "--out", run, "--model", "deepfm",
         "--preset", "debug", "--max-steps", "60", "--no-progress"],
        check=True,
    )  # fmt: skip
    assert re.fullmatch(r"validation AUC 0\.\d{4} logloss \d\.\d{4}", last_line(p.stdout))
    # a file with malformed lines: they are counted (with line numbers), the rest is scored
    lines = frappe.read_text().splitlines()[51950:53950]
    lines[10], lines[500] = "1 not-a-feature", "7 1:1"
    data = tmp_path / "test.libfm"
    data.write_text("\n".join(lines) + "\n")
    e = run_cli(["pctr", "eval", "--model", run, "--data", data, "--format", "libfm"], check=True)
    m = re.fullmatch(r"AUC (0\.\d{4}) logloss (\d\.\d{4})", last_line(e.stdout))
    assert m, e.stdout
    r = json.loads((run / "eval.json").read_text())
    assert (r["rows"], r["skipped"]) == (1998, 2) and sorted(r["skipped_examples"]) == ["11", "501"]
    assert f"{r['auc']:.4f}" == m.group(1) and r["auc"] > 0.7
    # the serving API scores the same lines identically, OOV ids included, and reports bad lines
    pred = load_predictor(run)
    feats = [ln.split(None, 1)[1] for ln in lines[20:70]]
    probs, errors = pred.predict_lines([*feats, "99999999:1 88888888:1", "x"])
    assert list(errors) == [51] and probs[51] is None and 0 < probs[50] < 1
    batch, _ = pred.parse(feats)
    np.testing.assert_allclose(pred.predict(batch), probs[:50], atol=1e-6)
    bad = run_cli(["pctr", "eval", "--model", run, "--data", data, "--format", "criteo"])
    assert bad.returncode == 2 and "trained on libfm" in bad.stderr


def test_bad_input_fails_fast_with_a_clear_error(data_dir, tmp_path):
    data = tmp_path / "bad.libfm"
    data.write_text("garbage\nmore garbage\n")
    args = ["pctr", "train", "--data", data, "--format", "libfm", "--out", tmp_path / "r"]
    p = run_cli([*args, "--servers", "1", "--workers", "1"], timeout=60)
    assert p.returncode == 2 and "no valid libFM line" in p.stderr
    assert "torchrun" not in p.stderr  # rejected by the master before any process was started
    args[3] = data_dir / "frappe" / "frappe.validation.libfm"
    p = run_cli([*args, "--split", "0.5,0.6,0.1"], timeout=60)
    assert p.returncode == 2 and "--split" in p.stderr
