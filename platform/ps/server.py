"""The parameter-server process: shard ``i`` of every table, slice ``i`` of the dense parameters (server 0:
also the worker clocks, the checkpoint coordinator and the key map), answering the workers' calls until told to
finish. Consistency modes (``staleness`` -1 asynchronous, 0 bulk-synchronous, s > 0 bounded) and key maps:
apps/pctr/README.md, "Parameter-server mode" and "Dynamic ids".

Every public method of `ParamServer` is an entry point, served as ``"ps"`` through transport.py
(`runtime.ps_session`); workers call it through handles (`runtime.remote`).
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

import numpy as np
import torch

from ..core.atomic import atomic_torch_save, atomic_write_text
from ..core.faults import FaultInjector
from ..sparse.rules import coalesce
from .dense import DenseStore
from .runtime import remote
from .shard import EmbeddingShard

log = logging.getLogger("mariana")


class ParamServer:
    def __init__(
        self,
        index: int,
        num_servers: int,
        num_workers: int,
        shard: EmbeddingShard,
        dense: DenseStore | None,
        staleness: int = -1,
        ckpt_dir: str | Path | None = None,
        keep: int = 2,
    ):
        self.index, self.num_servers, self.num_workers = index, num_servers, num_workers
        self.shard, self.dense, self.staleness = shard, dense, staleness
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir else None
        self.keep = keep
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.applied = -1  # bulk-synchronous mode: last step applied by all workers
        self.buffer: dict[int, list] = {}
        self.clocks: dict[int, int] = {}
        self.done: set[int] = set()
        self.ckpt_lock = threading.Lock()
        self.counters = {"pulls": 0, "pushes": 0, "rows_pulled": 0, "rows_pushed": 0, "stale_skips": 0}
        self.keymap = None  # optional key -> row map (see the module docstring); set before `install`
        self.keymap_lock = threading.Lock()
        self.assigned: dict[int, dict[int, tuple]] = {}  # worker -> step -> (rows, evicted), the last few
        self.faults = FaultInjector("push")  # MARIANA_FAULT server=S:push=N
        self._peers: list | None = None  # handles of servers 1.. (server 0 coordinates their checkpoints)

    # ----------------------------------------------------------------- pull / push
    def pull(self, reqs: list[tuple[str, torch.Tensor]], want_dense: bool, step: int, resets=None):
        """``reqs``: (table, local rows [U]); ``resets``: (table, local rows [E], weights [E, K]) to start
        over before reading (a key map's evicted rows)."""
        if self.staleness == 0 and step >= 0:
            with self.cond:
                self.cond.wait_for(lambda: self.applied >= step - 1 or self.stop.is_set())
        for name, r, w in resets or ():
            self.shard.reset(name, r, w)
        rows = [self.shard.pull(name, r) for name, r in reqs]
        self.counters["pulls"] += 1
        self.counters["rows_pulled"] += sum(r.numel() for _, r in reqs)
        dense = self.dense.pull() if (want_dense and self.dense is not None) else None
        return rows, dense

    def push(self, grads: list[tuple[str, torch.Tensor, torch.Tensor]], dense_grad, worker: int, step: int):
        """Apply (or, bulk-synchronous, buffer) worker ``worker``'s gradients of ``step``: ``grads`` (table,
        local rows [U], grad [U, K]), ``dense_grad`` [P_i] or None. False for a replayed step."""
        self.faults.maybe_fire(self.counters["pushes"] + 1)  # the injection point of ``push=N`` faults
        self.counters["pushes"] += 1
        self.counters["rows_pushed"] += sum(r.numel() for _, r, _ in grads)
        if self.staleness != 0:
            for name, rows, g in grads:
                if not self.shard.push(name, rows, g, worker, step):
                    self.counters["stale_skips"] += 1
            if dense_grad is not None and self.dense is not None:
                self.dense.push(dense_grad, worker, step)
            return True
        with self.cond:
            if step <= self.applied:  # replay after a restore: applied already
                return False
            bucket = self.buffer.setdefault(step, [])
            if any(w == worker for w, _, _ in bucket):
                return False
            bucket.append((worker, grads, dense_grad))
            self._apply_ready()
        return True

    def _apply_ready(self) -> None:
        """Apply the buffered synchronous steps, in order, whose every worker pushed or is done (a worker
        that stopped early, e.g. by early stopping, no longer holds the others back). Holds ``cond``."""
        while self.applied + 1 in self.buffer:
            step = self.applied + 1
            have = {w for w, _, _ in self.buffer[step]}
            if not all(w in have or w in self.done for w in range(self.num_workers)):
                return
            self._apply_sync(step, self.buffer.pop(step))
            self.applied = step
            self.cond.notify_all()

    def _apply_sync(self, step: int, bucket: list) -> None:
        scale = 1.0 / len(bucket)  # the mean over the workers that took part
        bucket = sorted(bucket, key=lambda b: b[0])  # summed in worker order, not arrival order: the same
        # rounding whichever push came first (a one-process step sums the batch's halves in that order)
        names = {name for _, grads, _ in bucket for name, _, _ in grads}
        for name in sorted(names):
            rows = torch.cat([r for _, grads, _ in bucket for n, r, _ in grads if n == name])
            g = torch.cat([x for _, grads, _ in bucket for n, _, x in grads if n == name])
            rows, g = coalesce(rows, g)
            self.shard.push(name, rows, g, scale=scale)
            for w, _, _ in bucket:
                self.shard.last_step[(name, w)] = step
        if self.dense is not None:
            dg = [d for _, _, d in bucket if d is not None]
            if dg:
                self.dense.push(torch.stack(dg).sum(0), scale=scale)
            for w, _, _ in bucket:
                self.dense.last_step[w] = step

    # ----------------------------------------------------------------- key map (server 0)
    def assign(self, keys: torch.Tensor, worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``keymap.assign`` of worker ``worker``'s batch of ``step``: (rows [B, F], evicted rows [E]).
        Maps are applied in arrival order under one lock; a step this worker was already answered (a
        replay after a restore: the map is one or two steps ahead of the restored shards when pulls were
        sent ahead) gets the same answer again, counted once."""
        with self.keymap_lock:
            mine = self.assigned.setdefault(worker, {})
            if step >= 0 and step in mine:
                return mine[step]
            rows, evicted = self.keymap.assign(keys.numpy())
            out = (
                torch.from_numpy(np.ascontiguousarray(rows)),
                torch.from_numpy(np.asarray(evicted, np.int64)),
            )
            if step >= 0:
                mine[step] = out
                for s in [s for s in mine if s < step - 4]:
                    del mine[s]
            return out

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """Read-only ``keymap.lookup``: keys [n, F] -> rows [n, F] (validation)."""
        with self.keymap_lock:
            return torch.from_numpy(self.keymap.lookup(keys.numpy()))

    def keymap_state(self) -> dict:
        """The map's ``row_key`` [rows] (the key held by each table row, -1 none) and ``counters()``."""
        with self.keymap_lock:
            return {
                "row_key": torch.from_numpy(self.keymap.row_key.copy()),
                "counters": self.keymap.counters(),
            }

    def _keymap_sd(self) -> dict:
        with self.keymap_lock:
            return {
                "map": self.keymap.state_dict(),
                "assigned": {
                    str(w): {str(s): (r.clone(), e.clone()) for s, (r, e) in d.items()}
                    for w, d in self.assigned.items()
                },
            }

    # ----------------------------------------------------------------- clocks (server 0)
    def clock(self, worker: int, step: int) -> None:
        with self.cond:
            self.clocks[worker] = max(step, self.clocks.get(worker, -1))
            self.cond.notify_all()

    def wait_clock(self, step: int, staleness: int) -> None:
        need = step - staleness - 1

        def ok():
            return all(w in self.done or self.clocks.get(w, -1) >= need for w in range(self.num_workers))

        with self.cond:
            self.cond.wait_for(lambda: ok() or self.stop.is_set())

    def worker_done(self, worker: int) -> None:
        with self.cond:
            self.done.add(worker)
            if self.staleness == 0:
                self._apply_ready()
            self.cond.notify_all()

    def wait_all_done(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: len(self.done) >= self.num_workers or self.stop.is_set())

    def resume_step(self, worker: int) -> int:
        s = self.shard.worker_step(worker)
        if self.dense is not None:
            s = min(s, self.dense.worker_step(worker))
        return s

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self, copy: bool = True) -> dict:
        sd = {"shard": self.shard.state_dict(copy), "applied": self.applied}
        if self.dense is not None:
            sd["dense"] = self.dense.state_dict()
        if self.keymap is not None:
            sd["keymap"] = self._keymap_sd()
        return sd

    def save_shard(self, folder: str, step: int = -1) -> str:
        """Write this shard's file; pushes wait meanwhile, so the file is one consistent state.

        Bulk-synchronous: worker 0 asks for checkpoint ``step`` after pushing its step ``step - 1``
        (0-based); while the other workers' pushes of that step are still on their way, wait for them, so
        that every shard holds steps ``0..step-1`` (no later step can be applied before worker 0 goes on).
        Shards saved one step apart would, after a restore, replay that step on the lagging shard from the
        other shard's newer state and end with a different model than an uninterrupted run."""
        if self.staleness == 0 and step > 0:
            with self.cond:
                self.cond.wait_for(lambda: (step - 1) not in self.buffer or self.stop.is_set())
        path = Path(folder) / f"shard-{self.index}.pt"
        with self.shard.frozen():
            atomic_torch_save(self.state_dict(copy=False), path)
        return str(path)

    def restore_latest(self) -> int | None:
        """Load this server's file from ``checkpoints/latest``; returns the checkpoint's step or None."""
        if self.ckpt_dir is None or not (self.ckpt_dir / "latest").is_file():
            return None
        name = (self.ckpt_dir / "latest").read_text().strip()
        sd = torch.load(self.ckpt_dir / name / f"shard-{self.index}.pt", weights_only=True)
        self.shard.load_state_dict(sd["shard"])
        if self.dense is not None and "dense" in sd:
            self.dense.load_state_dict(sd["dense"])
        self.applied = int(sd.get("applied", -1))
        if self.keymap is not None:
            if "keymap" not in sd:
                raise ValueError(
                    f"checkpoint {name} of server {self.index} holds no key map (another --ids?)"
                )
            with self.keymap_lock:
                self.keymap.load_state_dict(sd["keymap"]["map"])
                self.assigned = {
                    int(w): {int(s): tuple(v) for s, v in d.items()}
                    for w, d in sd["keymap"]["assigned"].items()
                }
        return int(name.split("_")[-1])

    def checkpoint(self, step: int) -> str:
        """Coordinator (server 0): every server writes its shard file into ``step_XXXXXXXX/``, then
        ``latest`` is switched atomically. Shards need not be frozen together: each records the last
        step of every worker it applied, and a resumed worker replays from the minimum, which the shards
        that were ahead ignore, so the restored state is exactly-once per shard."""
        assert self.ckpt_dir is not None
        with self.ckpt_lock:
            name = f"step_{step:08d}"
            folder = self.ckpt_dir / name
            folder.mkdir(parents=True, exist_ok=True)
            futs = [h.rpc_async().save_shard(str(folder), step) for h in self.peers()]
            self.save_shard(str(folder), step)
            for f in futs:
                f.wait()
            atomic_write_text(self.ckpt_dir / "latest", name + "\n")
            old = sorted(p for p in self.ckpt_dir.glob("step_*") if p.is_dir() and p.name != name)
            for p in old[: max(0, len(old) - (self.keep - 1))]:
                shutil.rmtree(p, ignore_errors=True)
            log.debug("checkpoint %s written (%d shards)", name, self.num_servers)
            return name

    def dump(self) -> dict:
        """The shard's weights (not its optimiser state), uncopied: called once every worker is done."""
        out = {n: (self.shard.weight[n].cpu(), self.shard.seen[n].cpu()) for n in self.shard.specs}
        dense = self.dense.pull() if self.dense is not None else None
        counters = dict(self.counters)
        if self.keymap is not None:
            counters.update(self.keymap_state()["counters"])
        return {"tables": out, "dense": dense, "counters": counters}

    def peers(self) -> list:
        """Handles of the other servers (made on first use, once every server announced itself)."""
        if self._peers is None:
            self._peers = [remote(i) for i in range(1, self.num_servers)]
        return self._peers

    def finish(self) -> bool:
        """Stop serving: `serve` returns, and every waiting call gives up."""
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
        return True

    def serve(self, poll_s: float = 0.2) -> None:
        while not self.stop.wait(poll_s):
            pass
