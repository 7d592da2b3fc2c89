"""Parameter-server training end to end through `mariana pctr train` (torchrun, TensorPipe RPC over
loopback, S=2 servers, W=2 workers): async accuracy, synchronous equivalence, and fault recovery. The
one-process reference runs go through the CLI's entry point in this process (`run_main`): no interpreter
of their own, the same parser, config and training code as ``mariana`` in a shell."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cliwalk import run_main
from helpers import last_line, run_cli
from mariana.apps.pctr.configs import parse_split
from mariana.apps.pctr.data.reader import shard_lines
from mariana.platform.core.export import load_exported
from mariana.platform.data.splits import split_bounds

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


def in_process(args: list, capsys) -> str:
    """``mariana <args>`` in this process (a one-process run: no launcher); asserts a zero exit and
    returns its stdout."""
    rc, out, err = run_main(args, capsys)
    assert rc == 0, f"mariana {args} exited {rc}\n{out[-4000:]}\n{err[-8000:]}"
    return out


def test_async_two_servers_two_workers_matches_single_process(frappe, tmp_path, capsys):
    one = in_process(lr_args(frappe, tmp_path / "one", "--schedule", "constant"), capsys)  # as the servers
    ps = run_cli(lr_args(frappe, tmp_path / "ps", "--servers", "2", "--workers", "2"), check=True)
    a1, a2 = final(tmp_path / "one")["val_auc"], final(tmp_path / "ps")["val_auc"]
    assert a1 > 0.85, a1  # LR on Frappe: well above chance after one epoch
    assert abs(a1 - a2) < 0.005, (a1, a2)
    assert last_line(one).startswith("validation AUC") and f"{a2:.4f}" in last_line(ps.stdout)
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


def side_by_side(src: str, dst: Path, batch: int, workers: int) -> None:
    """Write ``src`` reordered so that one process's step-t batch of ``workers * batch`` training rows is
    the W workers' step-t batches side by side (each worker reads its own contiguous share of the split);
    the validation and test lines stay where they are."""
    lines = Path(src).read_text().splitlines(keepends=True)
    a, b = split_bounds(len(lines), parse_split("0.8,0.1,0.1"))["train"]
    shares = [lines[lo:hi] for lo, hi in (shard_lines(a, b, w, workers) for w in range(workers))]
    steps = min(len(s) for s in shares) // batch
    train = [x for t in range(steps) for s in shares for x in s[t * batch : (t + 1) * batch]]
    train += [x for s in shares for x in s[steps * batch :]]
    assert sorted(train) == sorted(lines[a:b])
    dst.write_text("".join(lines[:a] + train + lines[b:]))


def test_staleness_zero_equals_synchronous_sgd(frappe, tmp_path, capsys):
    """Bulk-synchronous PS (W=2, batch B each, each worker on its own half of the training lines) = one
    process with batch 2B over the same rows in the same order, same math.

    Without --l2-emb: it regularises the rows each worker's batch looks up, so a row only one worker saw
    gets half the L2 of the 2B batch after the servers average the two pushes. The PS run leaves --l2-emb at
    its default, which pins that default to 0 for --model lr (0.01 cost PS LR on Frappe 0.92 -> 0.89 test
    AUC, issue 30)."""
    side_by_side(frappe, tmp_path / "side_by_side.libfm", 512, 2)
    in_process(
        lr_args(
            str(tmp_path / "side_by_side.libfm"), tmp_path / "sync", "--batch-size", "1024", "--no-shuffle",
            "--l2-emb", "0", "--schedule", "constant",
        ),
        capsys,
    )  # fmt: skip
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


# --- faults: a killed-and-restarted run must end with the model of the uninterrupted run ----------------
# Bulk-synchronous (--staleness 0) training is deterministic given the data order: every step applies the
# mean of both workers' gradients to the state after the previous step. A restart that lost, doubled or
# reordered a push would change the final model; the test compares every exported tensor.
# debug preset: DeepFM, 20 steps of 256 rows per worker; checkpoints at step 10 and at the end
FAULT_JOB = "--preset debug --servers 2 --workers 2 --staleness 0 --ckpt-every 10 --no-progress".split()
ATOL = 0.0  # bit-for-bit: the same sums of two gradients in the same order of steps


def fault_args(data, out, *extra):
    return ["pctr", "train", "--data", data, "--format", "libfm", "--out", out, *FAULT_JOB, *extra]


@pytest.fixture(scope="module")
def uninterrupted(frappe, tmp_path_factory):
    out = tmp_path_factory.mktemp("ps-fault") / "straight"
    run_cli(fault_args(frappe, out), check=True)
    c = json.loads((out / "counters.json").read_text())
    assert c["restarts"] == 0 and all(s["restored_from"] is None for s in c["servers"].values())
    return out


def assert_same_model(run, ref) -> None:
    got, want = load_exported(run)[0], load_exported(ref)[0]
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=ATOL, msg=k)
    assert final(run)["steps"] == final(ref)["steps"] == 20
    assert final(run)["val_auc"] == pytest.approx(final(ref)["val_auc"], abs=1e-6)


def test_pulls_sent_a_step_ahead_give_the_same_model(frappe, tmp_path, uninterrupted):
    """Under --staleness 0 a pull sent while the previous step computes (the default) returns the rows of
    one sent after the previous push: the model is bit-for-bit that of a run without pull-ahead."""
    out = tmp_path / "no-pull-ahead"
    run_cli(fault_args(frappe, out, "--no-pull-ahead"), check=True)
    assert_same_model(out, uninterrupted)
    assert "pull_ahead = false" in (out / "config.toml").read_text()
    assert "pull_ahead = true" in (uninterrupted / "config.toml").read_text()

    def pulled_ahead(run) -> list[tuple[int, int]]:  # (step, steps whose rows the loader pulled ahead)
        recs = [json.loads(x) for x in (run / "counters" / "worker-1.jsonl").read_text().splitlines()]
        return [(r["step"], r["pulled_ahead"]) for r in recs if "pulled_ahead" in r]

    ahead, plain = pulled_ahead(uninterrupted), pulled_ahead(out)
    assert ahead and all(n == step for step, n in ahead)  # every step's rows were pulled ahead
    assert plain and all(n == 0 for _, n in plain)


def assert_restored_from_checkpoint(run, step: int) -> None:
    """Both servers restarted from checkpoint ``step``, a real checkpoint: its folder holds both shard
    files (pruning keeps it: the run's only later checkpoint is the final one), saved at that step."""
    c = json.loads((run / "counters.json").read_text())
    assert c["restarts"] == 1
    servers = c["servers"]
    assert sorted(servers) == ["server-0", "server-1"]
    for name, s in servers.items():
        assert s["attempt"] == 1 and s["restored_from"] == step, (name, s)
    folder = run / "checkpoints" / f"step_{step:08d}"
    assert sorted(p.name for p in folder.iterdir()) == ["shard-0.pt", "shard-1.pt"]
    for i in (0, 1):  # one consistent cut: both shards hold exactly the bulk-synchronous steps 0..step-1
        saved = torch.load(folder / f"shard-{i}.pt", weights_only=True)
        last = saved["shard"]["tables"]["table"]["last_step"]
        assert (saved["applied"], last) == (step - 1, {"0": step - 1, "1": step - 1}), i
    for rank in (0, 1):
        log = (run / "logs" / f"rank-{rank}.log").read_text()
        assert f"restored shard from checkpoint step {step} (attempt 1)" in log
    # the workers of the second attempt continued after the checkpoint, not from scratch
    for w in ("worker-0", "worker-1"):
        recs = [json.loads(x) for x in (run / "counters" / f"{w}.jsonl").read_text().splitlines()]
        assert min(r["step"] for r in recs if r.get("attempt") == 1) >= step


def test_killed_worker_is_restarted_and_ends_with_the_uninterrupted_model(frappe, tmp_path, uninterrupted):
    out = tmp_path / "wk"
    # worker 1 dies before its 15th step: the last checkpoint is step 10 (worker 0 writes it after its
    # 10th step, and bulk-synchronous steps keep worker 1 within one step of worker 0)
    p = run_cli(fault_args(frappe, out), env={"MARIANA_FAULT": "kill:worker=1:step=15"})
    assert p.returncode == 0, p.stderr[-6000:]
    c = json.loads((out / "counters.json").read_text())
    assert c["workers"]["worker-1"]["attempts"] == [0, 1]
    assert_restored_from_checkpoint(out, 10)
    assert_same_model(out, uninterrupted)


def test_killed_server_restores_last_checkpoint_and_ends_with_the_uninterrupted_model(
    frappe, tmp_path, uninterrupted
):
    out = tmp_path / "sk"
    # server 1 dies at its 30th push (step 15 of both workers): the last checkpoint is step 10
    p = run_cli(fault_args(frappe, out), env={"MARIANA_FAULT": "kill:server=1:push=30"})
    assert p.returncode == 0, p.stderr[-6000:]
    assert_restored_from_checkpoint(out, 10)
    assert_same_model(out, uninterrupted)


def test_lost_updates_fail_the_comparison(frappe, tmp_path, uninterrupted):
    """The control: a run that misses one step's updates (19 steps instead of 20) is far outside the
    tolerance the fault tests use, so they would catch a restart that lost pushes."""
    out = tmp_path / "short"
    run_cli(fault_args(frappe, out, "--max-steps", "19"), check=True)
    got, want = load_exported(out)[0], load_exported(uninterrupted)[0]
    diff = max(float((got[k] - want[k]).abs().max()) for k in ("table.weight", "bias", "head.weight"))
    assert diff > 1e-4, diff


def test_unrecovered_failure_names_the_process_by_role(frappe, tmp_path):
    """Out of restarts: one line naming the failed process by its role and rank, and its cause."""
    out = tmp_path / "dead"
    p = run_cli(
        fault_args(frappe, out, "--max-restarts", "0", "--max-steps", "6"),
        env={"MARIANA_FAULT": "kill:worker=0:step=3"},
    )
    assert p.returncode == 1
    assert f"mariana: error: worker 0 (rank 2) was killed by SIGKILL (see {out}/logs/rank-2.log)" in p.stderr
    assert "Traceback" not in p.stderr
