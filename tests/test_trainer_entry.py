"""The Trainer's public entry points besides `fit`: `train_now` (a stream trains file by file with one
Trainer) and the fault injection points of the loop and of the parameter server (platform/core/faults.py)."""

from __future__ import annotations

import json

import pytest
import torch
from mariana.platform.core import faults
from mariana.platform.core.loop import Trainer
from mariana.platform.core.rundir import RunDir
from mariana.platform.core.steps import ModuleStep
from mariana.platform.ps.server import ParamServer
from mariana.platform.ps.shard import EmbeddingShard, TableSpec
from mariana.platform.runtime.dist import DistContext
from mariana.platform.sparse.rules import RowOptConfig
from test_trainer import Loader, cfg_, make, mse


class Part:
    """Batches ``lo..hi-1`` of ``loader`` as a one-pass loader (one 'file' of a stream)."""

    def __init__(self, loader: Loader, lo: int, hi: int):
        self.loader, self.lo, self.hi = loader, lo, hi
        self.batches_per_epoch = hi - lo

    def iterate(self, epoch: int, start: int = 0):
        for b in range(self.lo + start, self.hi):
            yield self.loader.x[b], self.loader.y[b]


def records(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_now_file_by_file_equals_one_fit_over_all_batches(tmp_path):
    """Three calls of `train_now` (3, 1 and 2 batches) give the weights of `fit` over the 6 batches, the
    train records carry the run's global step, and nothing else is written (no metrics.json, no
    checkpoint)."""
    data = Loader(6, 8)
    ref_model, ref = make(cfg_(tmp_path / "a", max_steps=6, log_every=1), tmp_path / "a", data)
    ref.fit()
    cfg = cfg_(tmp_path / "b", log_every=1)
    model, trainer = make(cfg, tmp_path / "b", Part(data, 0, 3))
    assert [trainer.train_now(Part(data, lo, hi)) for lo, hi in [(0, 3), (3, 4), (4, 6)]] == [3, 1, 2]
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    got, want = records(tmp_path / "b"), records(tmp_path / "a")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in got] == [r["loss"] for r in want if "loss" in r]
    assert not (tmp_path / "b" / "metrics.json").exists() and not RunDir(tmp_path / "b").has_checkpoint()
    assert (
        trainer.train_now(Part(data, 0, 1), start_step=10) == 1 and records(tmp_path / "b")[-1]["step"] == 11
    )


@pytest.fixture
def fault_env(monkeypatch):
    """Sets ``MARIANA_FAULT`` for this process (rank 0, a first attempt, no role until the test names one)."""
    for name in ("RANK", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(faults, "_roles", {})
    return lambda spec: monkeypatch.setenv(faults.ENV, spec)


def test_the_loops_fault_hook_fires_before_the_given_step(tmp_path, fault_env):
    """The Trainer's injection point: ``MARIANA_FAULT=raise:rank=0:step=3`` stops the run after exactly 2
    steps."""
    fault_env("raise:rank=0:step=3")
    cfg = cfg_(tmp_path, max_steps=5, log_every=1)
    torch.manual_seed(0)
    model, ctx = torch.nn.Linear(4, 1), DistContext()
    trainer = Trainer(cfg, ModuleStep(cfg, model, mse, ctx), Loader(5, 8), ctx, RunDir(tmp_path))
    with pytest.raises(ValueError, match="injected fault before step 3"):
        trainer.fit()
    assert trainer.step == 2


def test_the_servers_fault_hook_fires_before_the_given_push(fault_env):
    """The server's injection point: with ``MARIANA_FAULT=raise:server=0:push=2`` in server 0's process,
    the 2nd push raises before it is applied; the 1st was applied. A malformed kind is refused."""
    fault_env("raise:server=0:push=2")
    faults.set_role("server", 0)
    spec = TableSpec("t", 4, 2)
    shard = EmbeddingShard([spec], 0, 1, RowOptConfig(rule="sgd", lr=1.0), seed=0)
    before = shard.weight["t"].clone()
    server = ParamServer(0, 1, 1, shard, None)
    grad = [("t", torch.tensor([1]), torch.ones(1, 2))]
    server.push(grad, None, worker=0, step=0)
    with pytest.raises(ValueError, match="injected fault before push 2"):
        server.push(grad, None, worker=0, step=1)
    assert server.counters["pushes"] == 1
    torch.testing.assert_close(shard.weight["t"][1], before[1] - 1.0)
    fault_env("explode:server=0:push=1")
    with pytest.raises(ValueError, match="KIND one of kill, raise, hang"):
        faults.FaultInjector("push")
