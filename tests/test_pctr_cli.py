"""`mariana pctr train` (one process) -> `mariana pctr eval` -> the serving Predictor, end to end."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from helpers import last_line, run_cli
from mariana.apps.pctr.models.predict import load_predictor
from mariana.platform.core.rundir import eval_result_path
from trained_runs import cli_here, fresh_copy

pytestmark = pytest.mark.slow


def test_train_eval_predict_roundtrip(data_dir, frappe_deepfm, tmp_path):
    """The shared `trained_runs.FRAPPE_DEEPFM` (a DeepFM with dropout layers, which shift the MLP's
    indices: the loaders must agree), copied: eval writes its results into the run."""
    frappe = data_dir / "frappe" / "frappe.validation.libfm"
    run = fresh_copy(frappe_deepfm, tmp_path / "fm")
    assert re.fullmatch(r"validation AUC 0\.\d{4} logloss \d\.\d{4}", last_line(frappe_deepfm.stdout))
    # a file with malformed lines: they are counted (with line numbers), the rest is scored
    lines = frappe.read_text().splitlines()[51950:53950]
    lines[10], lines[500] = "1 not-a-feature", "7 1:1"
    data = tmp_path / "test.libfm"
    data.write_text("\n".join(lines) + "\n")
    e = cli_here(["pctr", "eval", "--model", run, "--data", data, "--format", "libfm"], check=True)
    m = re.fullmatch(
        r"AUC (0\.\d{4}) logloss (\d\.\d{4}) on (\S+) \(all split, 1998 rows\)", last_line(e.stdout)
    )
    assert m and m.group(3) == str(data), e.stdout
    assert "mariana: warning: skipped 2 malformed lines in" in e.stderr and "(first: line 11:" in e.stderr
    r = json.loads(eval_result_path(run, data).read_text())
    assert (r["rows"], r["skipped"]) == (1998, 2) and sorted(r["skipped_examples"]) == ["11", "501"]
    assert f"{r['auc']:.4f}" == m.group(1) and r["auc"] > 0.7
    # the serving API scores the same lines identically, OOV ids included, and reports bad lines
    pred = load_predictor(run)
    feats = [ln.split(None, 1)[1] for ln in lines[20:70]]
    probs, errors = pred.predict_lines([*feats, "99999999:1 88888888:1", "x"])
    # issue 30.4: a line without the 10 fields every training line had is refused, not scored
    assert sorted(errors) == [50, 51] and probs[51] is None and "fields of training" in errors[50]
    batch, _ = pred.parse(feats)
    np.testing.assert_allclose(pred.predict(batch), probs[:50], atol=1e-6)
    bad = cli_here(["pctr", "eval", "--model", run, "--data", data, "--format", "criteo"])
    assert bad.returncode == 2 and "trained on libfm" in bad.stderr


def test_bad_input_fails_fast_with_a_clear_error(data_dir, tmp_path):
    data = tmp_path / "bad.libfm"
    data.write_text("garbage\nmore garbage\n")
    args = ["pctr", "train", "--data", data, "--format", "libfm", "--out", tmp_path / "r"]
    p = cli_here([*args, "--servers", "1", "--workers", "1"])
    assert p.returncode == 2 and "no valid libFM line" in p.stderr
    assert "torchrun" not in p.stderr  # rejected by the master before any process was started
    args[3] = data_dir / "frappe" / "frappe.validation.libfm"
    p = cli_here([*args, "--split", "0.5,0.6,0.1"])
    assert p.returncode == 2 and "--split" in p.stderr


def test_training_warns_about_skipped_lines_and_eval_files_per_split(data_dir, tmp_path):
    lines = (data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines()[:1000]
    lines[16], lines[400], lines[850] = "1 broken", "x 1:1", "0 2:"
    data = tmp_path / "bad.libfm"
    data.write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    p = cli_here(
        ["pctr", "train", "--data", data, "--out", run, "--preset", "debug", "--max-steps", "3",
         "--batch-size", "64", "--no-progress"],
        check=True,
    )  # fmt: skip
    # two bad lines in the training split (lines 1-800), one in the validation split (801-900)
    assert f"mariana: warning: skipped 3 malformed lines in {data} (first: line 17: " in p.stderr
    assert json.loads((run / "metrics.json").read_text())["skipped_lines"] == 3
    for split in ("val", "test"):
        e = cli_here(["pctr", "eval", "--model", run, "--data", data, "--split", split], check=True)
        rows = 99 if split == "val" else 100
        assert last_line(e.stdout).endswith(f"on {data} ({split} split, {rows} rows)"), e.stdout
        assert json.loads(eval_result_path(run, data, split).read_text())["rows"] == rows


def test_progress_bar_on_a_terminal_only(data_dir, tmp_path):
    """With stderr on a terminal (a pseudo-terminal here) training draws a tqdm bar; piped, it does not."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    from helpers import ROOT, cli_env

    lines = (data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines(keepends=True)
    data = tmp_path / "small.libfm"
    data.write_text("".join(lines[:1000]))
    argv = ["pctr", "train", "--data", str(data), "--preset", "debug", "--max-steps", "3"]
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mariana.platform.cli", *argv, "--out", str(tmp_path / "tty")],
        cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=slave, text=True,
    )  # fmt: skip
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(timeout=300) == 0
    os.close(master)
    assert "train: 100%" in seen.decode(errors="replace") and "3/3" in seen.decode(errors="replace")
    piped = run_cli([*argv, "--out", tmp_path / "piped"], check=True)
    assert "train:" not in piped.stderr
