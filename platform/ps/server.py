"""The parameter-server process: holds shard ``i`` of every table and slice ``i`` of the dense parameters
(and, on server 0, the worker clocks and the checkpoint coordinator) and answers the workers' RPCs until
told to finish.

Consistency modes (``staleness``):
- ``-1`` (default): fully asynchronous. Each push is applied when it arrives; no worker ever waits for
  another (Downpour/Hogwild style).
- ``0``: bulk-synchronous. Pushes of step t are buffered until all W workers sent theirs, then the summed
  gradient / W is applied once; a pull for step t waits until step t-1 is applied. This is exactly
  synchronous SGD with the global batch (the equivalence test checks it).
- ``s > 0``: bounded staleness (SSP). Pushes apply at once, but a worker may start step t only after every
  unfinished worker completed step t-s-1 (server 0 keeps the clocks).

RPC handlers below are module-level functions (TensorPipe pickles references to them); they act on the
process-global server object ``_PS``.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import torch

from .dense import DenseStore
from .rowopt import coalesce
from .shard import EmbeddingShard

log = logging.getLogger("mariana")
_PS: ParamServer | None = None


def server_name(i: int) -> str:
    return f"ps{i}"


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

    # ----------------------------------------------------------------- pull / push
    def pull(self, reqs: list[tuple[str, torch.Tensor]], want_dense: bool, step: int):
        if self.staleness == 0 and step >= 0:
            with self.cond:
                self.cond.wait_for(lambda: self.applied >= step - 1 or self.stop.is_set())
        rows = [self.shard.pull(name, r) for name, r in reqs]
        self.counters["pulls"] += 1
        self.counters["rows_pulled"] += sum(r.numel() for _, r in reqs)
        dense = self.dense.pull() if (want_dense and self.dense is not None) else None
        return rows, dense

    def push(self, grads: list[tuple[str, torch.Tensor, torch.Tensor]], dense_grad, worker: int, step: int):
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
        return sd

    def save_shard(self, folder: str, step: int = -1) -> str:
        """Write this shard's file; pushes wait meanwhile, so the file is one consistent state.

        Bulk-synchronous: worker 0 asks for checkpoint ``step`` after pushing its step ``step - 1``
        (0-based); while the other workers' pushes of that step are still on their way, wait for them, so
        that every shard holds steps ``0..step-1`` (no later step can be applied before worker 0 goes on).
        Shards saved one step apart would, after a restore, replay that step on the lagging shard from the
        other shard's newer state and end with a different model than an uninterrupted run."""
        from ..core.atomic import atomic_torch_save

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
        return int(name.split("_")[-1])

    def checkpoint(self, step: int) -> str:
        """Coordinator (server 0): every server writes its shard file into ``step_XXXXXXXX/``, then
        ``latest`` is switched atomically. Shards need not be frozen together: each records the last
        step of every worker it applied, and a resumed worker replays from the minimum, which the shards
        that were ahead ignore, so the restored state is exactly-once per shard."""
        from torch.distributed import rpc

        from ..core.atomic import atomic_write_text

        assert self.ckpt_dir is not None
        with self.ckpt_lock:
            name = f"step_{step:08d}"
            folder = self.ckpt_dir / name
            folder.mkdir(parents=True, exist_ok=True)
            futs = [
                rpc.rpc_async(server_name(i), _save_shard, args=(str(folder), step))
                for i in range(1, self.num_servers)
            ]
            self.save_shard(str(folder), step)
            for f in futs:
                f.wait()
            atomic_write_text(self.ckpt_dir / "latest", name + "\n")
            old = sorted(p for p in self.ckpt_dir.glob("step_*") if p.is_dir() and p.name != name)
            for p in old[: max(0, len(old) - (self.keep - 1))]:
                import shutil

                shutil.rmtree(p, ignore_errors=True)
            log.debug("checkpoint %s written (%d shards)", name, self.num_servers)
            return name

    def dump(self) -> dict:
        """The shard's weights (not its optimiser state), uncopied: called once every worker is done."""
        out = {n: (self.shard.weight[n].cpu(), self.shard.seen[n].cpu()) for n in self.shard.specs}
        dense = self.dense.pull() if self.dense is not None else None
        return {"tables": out, "dense": dense, "counters": dict(self.counters)}

    def serve(self, poll_s: float = 0.2) -> None:
        while not self.stop.wait(poll_s):
            pass


# --------------------------------------------------------------------- RPC entry points (run on a server)
def _pull(reqs, want_dense, step):
    return _PS.pull(reqs, want_dense, step)


def _push(grads, dense_grad, worker, step):
    return _PS.push(grads, dense_grad, worker, step)


def _clock(worker, step):
    return _PS.clock(worker, step)


def _wait_clock(step, staleness):
    return _PS.wait_clock(step, staleness)


def _worker_done(worker):
    return _PS.worker_done(worker)


def _wait_all_done():
    return _PS.wait_all_done()


def _resume_step(worker):
    return _PS.resume_step(worker)


def _save_shard(folder, step=-1):
    return _PS.save_shard(folder, step)


def _checkpoint(step):
    return _PS.checkpoint(step)


def _dump():
    return _PS.dump()


def _finish():
    _PS.stop.set()
    with _PS.cond:
        _PS.cond.notify_all()
    return True


def _ping():
    return time.time()


def install(server: ParamServer) -> None:
    global _PS
    _PS = server
