"""`mariana pctr train --ids dynamic --servers S --workers W`: the id map on parameter server 0.

Real torchrun/RPC jobs (2 servers) on tiny Criteo data with more ads than rows: one bulk-synchronous worker
ends with exactly the one-process model and map (table, map, dense layers, counters), also after a worker
is killed and the job restarts from the servers' checkpoint; two asynchronous workers count their
evictions, and the exported model is served with the offline model's probabilities."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import run_cli
from mariana.apps.pctr.models.predict import load_predictor
from mariana.platform.core.export import load_exported
from test_pctr_dynamic_ids import R, criteo_lines, offline_probs
from trained_runs import run_ok

pytestmark = pytest.mark.slow

# 2400 training lines of 128 -> 18 steps; one evaluation, at the end (no mid-run pull-ahead in flight)
COMMON = [
    "--format", "criteo", "--ids", "dynamic", "--rows-per-field", str(R), "--admit-after", "2", "--evict",
    "lfu", "--model", "fm", "--dim", "4", "--batch-size", "128", "--epochs", "1", "--early-stop", "0",
    "--no-shuffle", "--l2-emb", "0", "--no-progress",
]  # fmt: skip
BSP = ["--servers", "2", "--workers", "1", "--staleness", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dyn-ps-data")
    (d / "train.tsv").write_text("\n".join(criteo_lines(3000, 0)) + "\n")
    return d / "train.tsv"


def train(data, out, *extra, env=None):
    return run_cli(["pctr", "train", "--data", data, "--out", out, *COMMON, *extra], env=env, check=True)


@pytest.fixture(scope="module")
def one(data, tmp_path_factory):
    """The one-process reference, made in this process (`trained_runs.run_ok`: no interpreter start-up);
    the parameter-server jobs compared with it are real torchrun jobs."""
    out = tmp_path_factory.mktemp("dyn-ps-one") / "run"
    run_ok(
        ["pctr", "train", "--data", data, "--out", out, *COMMON, "--schedule", "constant"]
    )  # as the servers
    return out


def metrics(run) -> dict:
    return json.loads((run / "metrics.json").read_text())


def assert_same_model(run, ref) -> None:
    got, want = load_exported(run)[0], load_exported(ref)[0]
    assert got.keys() == want.keys() and "idmap.row_key" in got
    for k in want:  # the map exactly; weights: the same updates in the same order
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)
    assert metrics(run)["ids"] == metrics(ref)["ids"]
    assert metrics(run)["val_auc"] == pytest.approx(metrics(ref)["val_auc"], abs=1e-6)


def test_one_bsp_worker_equals_one_process(data, one, tmp_path):
    ps = tmp_path / "ps"
    train(data, ps, *BSP)
    ids = metrics(one)["ids"]
    assert ids["ids_evicted"] > 20 and ids["ids_rows_in_use_per_field"][13] == R - 1  # C1: 600 ads, 31 rows
    assert_same_model(ps, one)
    assert (load_exported(one)[0]["table.weight"][:, 1:].abs() > 0.05).sum() > 50  # trained, not just drawn
    # the map lives on server 0: its counters; the worker counts the evictions its batches caused
    c = json.loads((ps / "counters.json").read_text())
    assert c["servers"]["server-0"]["ids_evicted"] == ids["ids_evicted"]
    assert "ids_evicted" not in c["servers"]["server-1"]
    recs = [json.loads(x) for x in (ps / "counters" / "worker-0.jsonl").read_text().splitlines()]
    logged = [r["ids_evicted"] for r in recs if "ids_evicted" in r]
    assert logged and logged == sorted(logged) and 0 < logged[-1] <= ids["ids_evicted"]
    # the exported model serves the one-process model's probabilities, never-seen ads included
    lines = [ln.split("\t", 1)[1] for ln in criteo_lines(300, 1, ads=600, first_ad=300)]
    probs, errors = load_predictor(ps).predict_lines(lines)
    assert not errors
    np.testing.assert_allclose(np.array(probs), offline_probs(one, lines), rtol=0, atol=1e-6)


def test_blocking_map_without_pull_ahead_equals_one_process(data, one, tmp_path):
    """--no-pull-ahead: each step maps its keys and pulls its rows in two blocking round trips."""
    out = tmp_path / "no-ahead"
    train(data, out, *BSP, "--no-pull-ahead")
    assert_same_model(out, one)
    recs = [json.loads(x) for x in (out / "counters" / "worker-0.jsonl").read_text().splitlines()]
    assert [r["pulled_ahead"] for r in recs if "pulled_ahead" in r] == [0]


def test_killed_worker_resumes_the_map_exactly(data, one, tmp_path):
    """Worker 0 dies before its 15th step; the job restarts from the servers' step-12 checkpoint. Server
    0 had already mapped batch 12 (its pull was sent ahead), so the checkpointed map is one batch ahead of
    the shards; the replayed step 12 gets the saved answer instead of counting its batch twice."""
    out = tmp_path / "killed"
    train(data, out, *BSP, "--ckpt-every", "6", env={"MARIANA_FAULT": "kill:worker=0:step=15"})
    c = json.loads((out / "counters.json").read_text())
    assert c["restarts"] == 1 and {s["restored_from"] for s in c["servers"].values()} == {12}
    saved = torch.load(out / "checkpoints" / "step_00000012" / "shard-0.pt", weights_only=True)
    assert saved["keymap"]["map"]["step"] == 13 and "12" in saved["keymap"]["assigned"]["0"]
    assert "keymap" not in torch.load(out / "checkpoints" / "step_00000012" / "shard-1.pt", weights_only=True)
    assert_same_model(out, one)


def test_two_async_workers_count_evictions_and_serve_the_export(data, tmp_path):
    out = tmp_path / "async"
    train(data, out, "--servers", "2", "--workers", "2", "--epochs", "2")
    ids = metrics(out)["ids"]
    assert ids["ids_evicted"] > 20 and ids["ids_admitted"] - ids["ids_evicted"] == ids["ids_rows_in_use"]
    assert ids["ids_rows_in_use"] <= ids["ids_capacity"] == 39 * (R - 1)
    c = json.loads((out / "counters.json").read_text())
    assert c["servers"]["server-0"]["ids_evicted"] == ids["ids_evicted"]
    per_worker = []  # the last count each worker logged of the evictions its batches caused
    for w in ("worker-0", "worker-1"):
        recs = [json.loads(x) for x in (out / "counters" / f"{w}.jsonl").read_text().splitlines()]
        per_worker.append([r["ids_evicted"] for r in recs if "ids_evicted" in r][-1])
    assert all(n > 0 for n in per_worker) and sum(per_worker) <= ids["ids_evicted"]
    state, _ = load_exported(out)
    row_key = state["idmap.row_key"].numpy()
    assert (row_key >= 0).sum() == ids["ids_rows_in_use"] and (row_key[::R] == -1).all()
    lines = [ln.split("\t", 1)[1] for ln in criteo_lines(300, 1, ads=600, first_ad=300)]
    probs, errors = load_predictor(out).predict_lines(lines)
    assert not errors
    np.testing.assert_allclose(np.array(probs), offline_probs(out, lines), rtol=0, atol=1e-6)
