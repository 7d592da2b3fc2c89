"""Parameter-server training end to end through `mariana pctr train` (torchrun, TensorPipe RPC over
loopback, S=2 servers, W=2 workers): async accuracy, synchronous equivalence, and fault recovery."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import last_line, run_cli
from mariana.platform.core.export import load_exported

pytestmark = pytest.mark.slow

ROWS = "8192"


def lr_args(data, out, *extra):
    return [
        "pctr", "train", "--data", data, "--format", "libfm", "--out", out, "--model", "lr",
        "--rows-per-field", ROWS, "--epochs", "1", "--no-progress", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def frappe(data_dir):
    return str(data_dir / "frappe" / "frappe.validation.libfm")


def final(run) -> dict:
    return json.loads((run / "metrics.json").read_text())


def test_async_two_servers_two_workers_matches_single_process(frappe, tmp_path):
    one = run_cli(lr_args(frappe, tmp_path / "one"), check=True)
    ps = run_cli(lr_args(frappe, tmp_path / "ps", "--servers", "2", "--workers", "2"), check=True)
    a1, a2 = final(tmp_path / "one")["val_auc"], final(tmp_path / "ps")["val_auc"]
    assert a1 > 0.85, a1  # LR on Frappe: well above chance after one epoch
    assert abs(a1 - a2) < 0.005, (a1, a2)
    assert last_line(one.stdout).startswith("validation AUC") and f"{a2:.4f}" in last_line(ps.stdout)
    m = final(tmp_path / "ps")
    assert m["mode"] == "parameter-server" and m["staleness"] == -1
    # the master merged every worker's counters (samples/s, loss, validation AUC) into the run directory
    c = json.loads((tmp_path / "ps" / "counters.json").read_text())
    assert sorted(c["workers"]) == ["worker-0", "worker-1"] and c["restarts"] == 0
    for w in c["workers"].values():
        assert w["val_auc"] > 0.8 and w["last"]["samples_per_s"] > 0
    losses = [
        json.loads(x)["loss"]
        for x in (tmp_path / "ps" / "counters" / "worker-1.jsonl").read_text().splitlines()
        if "loss" in json.loads(x)
    ]
    assert losses and all(0 < x < 1 for x in losses)
    pushes = [s["pushes"] for s in c["servers"].values()]
    assert len(pushes) == 2 and all(p > 0 for p in pushes)


def test_staleness_zero_equals_synchronous_sgd(frappe, tmp_path):
    """Bulk-synchronous PS (W=2, batch B each) = one process with batch 2B, same order, same math."""
    run_cli(lr_args(frappe, tmp_path / "sync", "--batch-size", "1024", "--no-shuffle"), check=True)
    run_cli(
        lr_args(
            frappe, tmp_path / "bsp", "--batch-size", "512", "--servers", "2", "--workers", "2",
            "--staleness", "0", "--no-shuffle",
        ),
        check=True,
    )  # fmt: skip
    ref, _ = load_exported(tmp_path / "sync")
    got, _ = load_exported(tmp_path / "bsp")
    assert final(tmp_path / "bsp")["steps"] == final(tmp_path / "sync")["steps"] == 45
    for k in ("table.weight", "bias", "seen"):
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-5)
    assert (ref["table.weight"] != 0).sum() > 1000  # the models really trained
    assert abs(final(tmp_path / "bsp")["val_auc"] - final(tmp_path / "sync")["val_auc"]) < 1e-4


def test_killed_worker_is_restarted_and_job_finishes(frappe, tmp_path):
    out = tmp_path / "wk"
    args = lr_args(frappe, out, "--servers", "2", "--workers", "2", "--ckpt-every", "10")
    p = run_cli(args, env={"MARIANA_PS_FAULT": "kill:worker=1:step=25"})
    assert p.returncode == 0, p.stderr[-6000:]
    c = json.loads((out / "counters.json").read_text())
    assert c["restarts"] == 1 and c["workers"]["worker-1"]["attempts"] == [0, 1]
    assert final(out)["val_auc"] > 0.85 and final(out)["steps"] == 45
    servers = list(c["servers"].values())
    assert all(s["attempt"] == 1 for s in servers)  # the group restarted from its last checkpoint (if any)
    assert servers[0]["restored_from"] == servers[1]["restored_from"]


def test_killed_server_restores_last_checkpoint(frappe, tmp_path):
    out = tmp_path / "sk"
    args = lr_args(frappe, out, "--servers", "2", "--workers", "2", "--ckpt-every", "10")
    p = run_cli(args, env={"MARIANA_PS_FAULT": "kill:server=1:push=50"})
    assert p.returncode == 0, p.stderr[-6000:]
    c = json.loads((out / "counters.json").read_text())
    assert c["restarts"] == 1
    restored = [s["restored_from"] for s in c["servers"].values()]
    # server 1 died at its 50th push (~step 25 of each worker): the last checkpoint was 10, 20 or 30
    assert restored[0] == restored[1] and restored[0] % 10 == 0 and 10 <= restored[0] < 45, restored
    assert "restored shard from checkpoint" in (out / "logs" / "rank-1.log").read_text()
    assert final(out)["val_auc"] > 0.85
