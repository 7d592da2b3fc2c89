"""`PSWorkerStep`: the `TrainStep` of a parameter-server worker: pull rows (and, from server 0, the dense
parameters), compute (`train_step`), push the rows' and the dense gradients; the servers apply them.

With a key map on server 0 (`KeyMap`, e.g. pCTR's ``--ids dynamic``) each batch's keys are first mapped
to rows there (`ParamServer.assign`); the rows it evicted are redrawn here (`fresh_rows`) and reset by
their servers within the pull. `RemoteIdMap` gives validation a read-only view of that map. The worker's
`BatchLoader` is `PullAheadLoader`, the Trainer's checkpointer of the job `ServerCheckpointer`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ..core.rundir import RunDir
from ..core.steps import autocast_for
from ..sparse.local import fresh_rows
from .dense import unflatten_into
from .protocol import TABLE, SparseBatch, SparseModel, StepConfig
from .pull import Done, Pulled, send_pull, train_step, write_counter


class RemoteIdMap:
    """Read-only `--ids dynamic` map on parameter server 0 (``lookup(keys [n, F]) -> rows [n, F]``, numpy),
    for a worker's validation."""

    def __init__(self, client):
        self.client = client

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        return self.client.lookup(torch.from_numpy(np.ascontiguousarray(keys, np.int64))).numpy()


class PendingMap(NamedTuple):
    """A batch pulled ahead under `--ids dynamic`: its keys are being mapped on server 0, and the answer's
    callback sends the pull; ``future.wait()`` -> its `Pulled`."""

    batch: SparseBatch
    future: Any


class PSWorkerStep:
    """`TrainStep` of a parameter-server worker (module docstring). ``evaluate(fn)`` first waits for this
    worker's pushes and pulls the current dense parameters."""

    data_parallel = 1

    def __init__(
        self,
        cfg: StepConfig,
        model: SparseModel,
        width: int,
        client,
        role,
        run: RunDir,
        dynamic: bool = False,
    ):
        """``model``: the dense layers (its table a stub: rows come from the servers); ``width``: the
        table's row width (1 + dim); ``client``: a `PSClient`; ``role``: this worker's `Role`;
        ``dynamic``: server 0 maps each batch's keys to rows first (a `KeyMap`)."""
        self.cfg, self.client, self.role, self.run = cfg, client, role, run
        self.device = torch.device("cpu")
        self.model = model
        self.amp = functools.partial(autocast_for, cfg, self.device)
        self.t, self.n, self.loss_sum, self.loss_n = 0, 0, 0.0, 0
        self.pulled_ahead = 0  # steps whose rows were pulled by `PullAheadLoader` (for the counters)
        self.t0 = time.perf_counter()
        self.dynamic, self.width = dynamic, width
        self.ids_evicted = 0  # rows evicted for this worker's batches
        self.assign_s = 0.0  # seconds waited for server 0's answers (keys -> rows)
        self._mapping = None  # the answer of the last batch sent ahead to server 0's map

    def setup(self, total_steps: int) -> None:
        pass

    @property
    def pulls_ahead(self) -> bool:
        return self.cfg.pull_ahead and self.client.can_pull_ahead

    def send_pull(self, batch: SparseBatch, step: int, ahead: bool = True) -> Pulled | PendingMap:
        """Start the pull of ``batch`` for ``step``. With `--ids dynamic` its keys are first mapped to rows
        on server 0 and the evicted rows' fresh weights travel with the pull: ahead (`PullAheadLoader`),
        the keys are sent at once and the pull when the answer arrives (a `PendingMap`), after the
        previous batch's answer, so this worker's batches reach the map in its order; ``ahead=False``:
        both blocking (honours ``--staleness s > 0``'s clock wait)."""
        if not self.dynamic:
            return send_pull(self.client, batch, step, want_dense=True)
        keys = batch.ids.cpu().contiguous()
        if not ahead:
            t0 = time.perf_counter()
            rows, evicted = self.client.assign(keys, step)
            self.assign_s += time.perf_counter() - t0
            return self._pull_mapped(batch, step, rows, evicted, ahead=False)
        if self._mapping is not None:
            t0 = time.perf_counter()
            self._mapping.wait()
            self.assign_s += time.perf_counter() - t0
        self._mapping = self.client.assign_async(keys, step)
        return PendingMap(batch, self._mapping.then(lambda f: self._pull_mapped(batch, step, *f.wait())))

    def wait_mapped(self) -> None:
        """Wait for server 0's answer to the batch sent ahead (`--ids dynamic`), so that a checkpoint
        taken now always holds it (the replay after a restart then takes the saved answer)."""
        if self._mapping is not None:
            self._mapping.wait()

    def _pull_mapped(self, batch: SparseBatch, step: int, rows, evicted, ahead: bool = True) -> Pulled:
        """The pull of ``batch`` whose keys server 0 mapped to ``rows`` [B, F], evicting ``evicted`` [E]."""
        self.ids_evicted += len(evicted)
        resets = None
        if len(evicted):
            resets = {
                TABLE: (
                    evicted,
                    fresh_rows(
                        self.cfg.seed, self.cfg.init_std, len(evicted), self.width, step, self.role.index
                    ),
                )
            }
        batch = replace(batch, ids=rows)
        uniq, inv = torch.unique(rows, return_inverse=True)
        if ahead:
            return Pulled(batch, uniq, inv, self.client.pull_async({TABLE: uniq}, step, True, resets))
        return Pulled(batch, uniq, inv, Done(self.client.pull({TABLE: uniq}, step, True, resets)))

    def train_step(self, micro_batches: list[SparseBatch | Pulled]) -> tuple[torch.Tensor, int]:
        (item,) = micro_batches
        self.pulled_ahead += isinstance(item, (Pulled, PendingMap))
        if isinstance(item, PendingMap):  # `--ids dynamic` ahead: the pull goes out with the map's answer
            t0 = time.perf_counter()
            item = item.future.wait()
            self.assign_s += time.perf_counter() - t0
        pulled = item if isinstance(item, Pulled) else None
        if pulled is None and self.dynamic:  # keys -> rows on server 0, then the pull
            pulled = self.send_pull(item, self.t, ahead=False)
        batch = pulled.batch if pulled is not None else item
        loss = train_step(
            self.model,
            self.client,
            batch,
            self.t,
            self.device,
            remote_dense=True,
            autocast=self.amp,
            clip_grad=self.cfg.clip_grad,
            l2_emb=self.cfg.l2_emb_value(),
            weight_decay=self.cfg.weight_decay,
            pulled=pulled,
        )
        self.t += 1
        self.n += len(batch)
        self.loss_sum += float(loss)
        self.loss_n += 1
        if self.t % self.cfg.log_every == 0:
            write_counter(
                self.run,
                self.role.index,
                {
                    "step": self.t,
                    "loss": self.loss_sum / max(1, self.loss_n),
                    "samples_per_s": self.n / (time.perf_counter() - self.t0),
                    "pull_s": self.client.pull_s,
                    "push_wait_s": self.client.push_wait_s,
                    "pulled_ahead": self.pulled_ahead,
                    **({"ids_evicted": self.ids_evicted, "assign_s": self.assign_s} if self.dynamic else {}),
                    "attempt": self.role.attempt,
                },
            )
            self.loss_sum, self.loss_n = 0.0, 0
        return loss, len(batch)

    def mean_loss(self, loss_sum: torch.Tensor, steps: int) -> float:
        return float(loss_sum) / max(1, steps)

    def pull_dense(self) -> None:
        self.client.wait()
        # bulk-synchronous: a pull for step t waits until every server applied step t - 1 of all workers,
        # so the evaluation sees the state after this worker's steps whatever the timing
        at = self.t if self.cfg.staleness == 0 else -1
        _, dense_flat = self.client.pull({TABLE: torch.zeros(0, dtype=torch.int64)}, at, True)
        unflatten_into(dense_flat, self.model.dense_parameters())

    def evaluate(self, fn) -> dict[str, float]:
        self.pull_dense()
        return fn(self)

    def checkpoint_state(self, folder: Path) -> dict[str, Any]:  # the servers hold the state
        return {}

    def restore(self, state: dict[str, Any], folder: Path) -> None:
        self.t = int(state["step"])

    def lrs(self) -> dict[str, float]:
        return {"lr": self.cfg.lr, "sparse_lr": self.cfg.sparse_lr}

    def comm_stats(self) -> tuple[float, int]:
        return self.client.pull_s, 0


class PullAheadLoader:
    """`BatchLoader` of a parameter-server worker: hands out `Pulled` batches, sending the pull of batch
    t+1 before batch t goes to the step, so those rows travel while step t computes."""

    def __init__(self, loader, step: PSWorkerStep):
        self.loader, self.step = loader, step
        self.batches_per_epoch = loader.batches_per_epoch

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Pulled]:
        it = iter(self.loader.iterate(epoch, start))
        try:
            nxt = next(it, None)
            ahead = None if nxt is None else self.step.send_pull(nxt, self.step.t)
            while ahead is not None:
                cur = ahead
                nxt = next(it, None)
                ahead = None if nxt is None else self.step.send_pull(nxt, self.step.t + 1)
                yield cur
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()  # the parsing thread


class ServerCheckpointer:
    """Checkpoints of a parameter-server job: worker 0 asks the servers to write their shards (the
    servers' own atomic protocol, `ParamServer.checkpoint`); on start every worker asks the servers at
    which step to continue (0 on a fresh job). The final checkpoint is written after all workers are done
    (by the job's end), not here."""

    resume_from_servers = True

    def __init__(self, client, worker: int, total: int, steps_per_epoch: int):
        self.client, self.worker, self.total, self.spe = client, worker, total, steps_per_epoch

    def save(self, step: PSWorkerStep, progress: dict[str, Any]) -> None:
        n = progress["step"]
        if self.worker == 0 and n < self.total:
            step.wait_mapped()
            self.client.checkpoint(n)

    def load(self, step: PSWorkerStep) -> dict[str, Any] | None:
        n = self.client.resume_step()
        if n <= 0:
            return None
        epoch, pos = divmod(n, self.spe)
        state = {"step": n, "data": {"epoch": epoch, "batch": pos}}
        step.restore(state, Path("."))
        return state
