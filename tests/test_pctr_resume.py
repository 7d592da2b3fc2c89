"""`mariana pctr train --servers 0`: checkpoints and an exact `--resume` (k steps + stop + k steps == 2k).

A small training split (10 batches per epoch) makes the runs cross into epoch 2, whose batches come shuffled
from the in-memory cache; dropout makes the result depend on the restored RNG state too."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import last_line, run_cli
from mariana.platform.core.export import load_exported
from trained_runs import cli_here, run_ok

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def frappe(data_dir, tmp_path_factory):
    """The first 4000 lines of the Frappe sample: 2800 training rows (10 batches of 256), 400 validation."""
    lines = (data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines(keepends=True)
    path = tmp_path_factory.mktemp("pctr-data") / "frappe4k.libfm"
    path.write_text("".join(lines[:4000]))
    return path


def args(data, out, *extra):
    return [
        "pctr", "train", "--data", data, "--out", out, "--preset", "debug", "--split", "0.7,0.1,0.2",
        "--dropout", "0.1", "--lr", "0.01", "--no-progress", *extra,
    ]  # fmt: skip


def assert_same_model(a_run, b_run):
    a, b = load_exported(a_run)[0], load_exported(b_run)[0]
    assert a.keys() == b.keys() and "table.weight" in a and "seen" in a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def straight(frappe, tmp_path_factory):
    """The uninterrupted reference run, made in this process (`trained_runs.run_ok`, as a CLI subprocess
    would make it: one thread, no CUDA); the runs stopped, killed and resumed are real subprocesses."""
    out = tmp_path_factory.mktemp("pctr-resume") / "straight"
    run_ok(args(frappe, out, "--max-steps", "16"))
    return out


def test_stop_and_resume_equals_uninterrupted(frappe, straight, tmp_path):
    out = tmp_path / "broken"
    run_ok(args(frappe, out, "--max-steps", "8", "--ckpt-every", "8"))  # in this process: only its checkpoint
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000008"
    first = load_exported(out)[0]["table.weight"]
    p = cli_here(args(frappe, out, "--max-steps", "16", "--resume"), check=True)
    assert last_line(p.stdout).startswith("validation AUC")
    assert_same_model(straight, out)
    # the comparison is between trained states, not two copies of the k-step model
    assert not torch.allclose(first, load_exported(out)[0]["table.weight"])
    final = json.loads((out / "metrics.json").read_text())
    assert final["steps"] == 16 and final["epochs"][-1]["epoch"] == 1


def test_killed_run_resumes_exactly_from_an_epoch_end_checkpoint(frappe, straight, tmp_path):
    out = tmp_path / "killed"
    # checkpoint at step 10 = the end of epoch 1 (10 batches), before its validation; SIGKILL before step 13
    p = run_cli(
        args(frappe, out, "--max-steps", "16", "--ckpt-every", "10", "--log-every", "1"),
        env={"MARIANA_FAULT": "kill:rank=0:step=13"},
    )
    assert p.returncode != 0 and not (out / "metrics.json").exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000010"
    again = cli_here(args(frappe, out, "--max-steps", "16", "--ckpt-every", "10"))
    assert again.returncode == 2 and "--resume" in again.stderr  # never trained over without --resume
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert 12 in steps  # the killed attempt logged steps past its checkpoint, which the resume redoes
    cli_here(
        args(frappe, out, "--max-steps", "16", "--ckpt-every", "10", "--resume", "--log-every", "1"),
        check=True,
    )
    assert_same_model(straight, out)
    epochs = json.loads((out / "metrics.json").read_text())["epochs"]
    assert [(e["epoch"], e["step"]) for e in epochs] == [(0, 10), (1, 16)]
    # metrics.jsonl: each step's train record once, in order (curves must not double back after a resume)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, 17))
    keys = [(r["step"], tuple(sorted(r.keys() - {"time"}))) for r in recs]
    assert len(keys) == len(set(keys))


def test_schedule_warmup_and_eval_every_are_honoured(frappe, tmp_path):
    out = tmp_path / "sched"
    cli_here(
        args(frappe, out, "--max-steps", "6", "--log-every", "1", "--eval-every", "3", "--schedule", "linear",
             "--warmup-steps", "2", "--sparse-lr", "0.1"),
        check=True,
    )  # fmt: skip
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    factors = [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]  # linear warm-up over 2 steps, then linear decay to 0 at 6
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in steps] == pytest.approx([0.01 * f for f in factors])
    assert [r["sparse_lr"] for r in steps] == pytest.approx([0.1 * f for f in factors])
    evals = [r for r in recs if "eval_auc" in r]
    assert [r["step"] for r in evals] == [3, 6] and 0 < evals[0]["eval_auc"] < 1


def test_dynamic_ids_resume_exactly(frappe, tmp_path):
    """`--ids dynamic` with evictions: the id map (keys, counts, sketch) is part of the checkpoint, so
    8 steps + `--resume` + 8 steps equal 16 steps, map and table included."""
    dyn = ["--ids", "dynamic", "--rows-per-field", "64", "--admit-after", "2", "--sketch-width", "512"]
    straight = tmp_path / "dyn-straight"
    run_ok(args(frappe, straight, "--max-steps", "16", *dyn))  # the reference and the first half in this
    out = tmp_path / "dyn-broken"  # process (`trained_runs.run_ok`); the resume is a real subprocess
    run_ok(args(frappe, out, "--max-steps", "8", "--ckpt-every", "8", *dyn))
    cli_here(args(frappe, out, "--max-steps", "16", "--resume", *dyn), check=True)
    assert_same_model(straight, out)
    assert "idmap.row_key" in load_exported(out)[0]
    a, b = (json.loads((r / "metrics.json").read_text())["ids"] for r in (straight, out))
    assert a == b and a["ids_evicted"] > 0  # the runs did evict rows
