"""Row sharding of embedding tables and the in-memory shard a parameter server holds.

Global row ``r`` of a table lives on shard ``r % S`` at local index ``r // S`` (round-robin, so hashed ids
spread evenly and hot rows of one field do not pile onto one server). A shard holds, per table, the weight
``[ceil((N - s) / S), K]``, the row optimiser state, a ``seen`` flag per row (set by the first push: rows
never trained are mapped to the out-of-vocabulary row at prediction time) and, per worker, the last step
whose push it applied (so that a push replayed after a restore is applied exactly once). Pushes are applied
through each table's row store (`mariana.platform.sparse.store.local_store`: the C loops on a float32 CPU
table for the rules they cover), the one-process step's own.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

from ..sparse.rules import RowOptConfig, init_state, table_empty
from ..sparse.store import local_store


@dataclass(frozen=True)
class TableSpec:
    """One sharded table: ``num_rows`` x ``dim`` floats, initialised N(0, init_std) (seeded per shard)."""

    name: str
    num_rows: int
    dim: int
    init_std: float = 0.01


def init_rows(spec: TableSpec, seed: int, shard: int = 0, num_shards: int = 1, chunk: int = 1 << 20):
    """Initial weights of the rows ``shard::num_shards`` of a table, identical whatever the sharding:
    N(0, init_std) drawn in global row order from per-chunk generators (column 0, the linear weight,
    starts at 0 as in plain logistic regression)."""
    out = table_empty((local_rows(spec.num_rows, shard, num_shards), spec.dim))
    off = 0
    for c0 in range(0, spec.num_rows, chunk):
        n = min(chunk, spec.num_rows - c0)
        gen = torch.Generator().manual_seed(seed * 7919 + c0 // chunk)
        w = torch.randn(n, spec.dim, generator=gen) * spec.init_std
        first = (shard - c0) % num_shards
        part = w[first::num_shards]
        out[off : off + len(part)] = part
        off += len(part)
    assert off == out.shape[0], (off, out.shape)
    out[:, 0] = 0.0
    return out


def contiguous_part(total: int, index: int, parts: int) -> tuple[int, int]:
    """Part ``index`` ``[lo, hi)`` of ``total`` items cut into ``parts`` contiguous pieces in order, their
    sizes differing by at most one (the dense parameters' slices per server, a worker's lines)."""
    if not 0 <= index < parts:
        raise ValueError(f"part {index} is not in [0, {parts})")
    return total * index // parts, total * (index + 1) // parts


def local_rows(num_rows: int, shard: int, num_shards: int) -> int:
    """How many rows of an ``num_rows`` table shard ``shard`` holds."""
    return (num_rows - shard + num_shards - 1) // num_shards


def split_by_shard(rows: torch.Tensor, num_shards: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each shard: (positions in ``rows`` [u_s], local rows [u_s])."""
    if num_shards == 1:
        return [(torch.arange(rows.numel(), device=rows.device), rows)]
    sh, loc = rows % num_shards, rows // num_shards  # global row r: shard r % S, local row r // S
    pos = [(sh == s).nonzero(as_tuple=True)[0] for s in range(num_shards)]
    return [(p, loc.index_select(0, p)) for p in pos]


class EmbeddingShard:
    """Shard ``shard`` of ``num_shards`` of some tables, with thread-safe pull and push.

    ``pull(name, local_rows [U]) -> [U, K]``; ``push(name, local_rows [U] unique, grad [U, K], worker, step)``.
    Reads never block writes for long: one lock per table guards the row update (a few index ops)."""

    def __init__(
        self,
        tables: list[TableSpec],
        shard: int,
        num_shards: int,
        opt: RowOptConfig,
        seed: int = 0,
        device: str | torch.device = "cpu",
        weights: dict[str, torch.Tensor] | None = None,
    ):
        self.shard, self.num_shards, self.opt = shard, num_shards, opt
        self.specs = {t.name: t for t in tables}
        self.weight: dict[str, torch.Tensor] = {}
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.seen: dict[str, torch.Tensor] = {}
        self.locks = {t.name: threading.Lock() for t in tables}
        self.last_step: dict[tuple[str, int], int] = {}  # (table, worker) -> last applied step
        for t in tables:
            n = local_rows(t.num_rows, shard, num_shards)
            if weights is not None and t.name in weights:  # adopt (share) an existing tensor
                self.weight[t.name] = weights[t.name]
            else:
                self.weight[t.name] = init_rows(t, seed, shard, num_shards).to(device)
            assert self.weight[t.name].shape == (n, t.dim), (self.weight[t.name].shape, n, t.dim)
            self.state[t.name] = init_state(opt.rule, self.weight[t.name], opt)
            self.seen[t.name] = torch.zeros(n, dtype=torch.bool, device=self.weight[t.name].device)
        # table -> its row store over weight, state and seen (made anew when a checkpoint replaces them)
        self.rows = {n: local_store(self.weight[n], self.state[n], self.seen[n]) for n in self.specs}

    def pull(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        return self.weight[name].index_select(0, rows.to(self.weight[name].device))

    def push(
        self, name: str, rows: torch.Tensor, grad: torch.Tensor, worker: int = -1, step: int = -1, scale=1.0
    ) -> bool:
        """Apply a push; returns False (and changes nothing) if this worker's ``step`` was applied already."""
        dev = self.weight[name].device
        rows, grad = rows.to(dev), grad.to(dev)
        with self.locks[name]:
            if worker >= 0:
                key = (name, worker)
                if step <= self.last_step.get(key, -1):
                    return False
                self.last_step[key] = step
            self.rows[name].apply(rows, grad, self.opt, scale)
        return True

    def reset(self, name: str, rows: torch.Tensor, weight: torch.Tensor) -> None:
        """Start local ``rows`` [E] over as new rows: weights ``weight`` [E, K], fresh optimiser state,
        not ``seen`` (a key map handed them to new keys)."""
        if rows.numel() == 0:
            return
        with self.locks[name]:
            self.rows[name].reset(rows.to(self.weight[name].device), weight, self.opt)

    def worker_step(self, worker: int) -> int:
        """Last step of ``worker`` applied on every table of this shard (-1: none)."""
        return min((self.last_step.get((n, worker), -1) for n in self.specs), default=-1)

    def state_dict(self, copy: bool = True) -> dict:
        """Tensors + numbers only (loadable with ``weights_only=True``).

        ``copy=True``: copied under the locks. ``copy=False``: the live tensors, for a caller that holds
        `frozen()` until it has written them (no second copy of a multi-GB shard in memory)."""
        out: dict = {"shard": self.shard, "num_shards": self.num_shards, "tables": {}}
        c = (lambda t: t.cpu().clone()) if copy else (lambda t: t.cpu())
        for name in self.specs:
            with self.locks[name] if copy else contextlib.nullcontext():
                out["tables"][name] = {
                    "weight": c(self.weight[name]),
                    "seen": c(self.seen[name]),
                    "state": {k: c(v) for k, v in self.state[name].items()},
                    "last_step": {str(w): s for (n, w), s in self.last_step.items() if n == name},
                }
        return out

    @contextlib.contextmanager
    def frozen(self):
        """Hold every table's lock: pushes wait until the block ends (pulls are not locked)."""
        with contextlib.ExitStack() as stack:
            for name in sorted(self.locks):
                stack.enter_context(self.locks[name])
            yield self

    def load_state_dict(self, sd: dict) -> None:
        if sd["shard"] != self.shard or sd["num_shards"] != self.num_shards:
            raise ValueError(
                f"checkpoint holds shard {sd['shard']}/{sd['num_shards']}, this is {self.shard}/{self.num_shards}"
            )
        for name, t in sd["tables"].items():
            with self.locks[name]:
                dev = self.weight[name].device
                self.weight[name] = t["weight"].to(dev)
                self.seen[name] = t["seen"].to(dev)
                self.state[name] = {k: v.to(dev) for k, v in t["state"].items()}
                for w, s in t["last_step"].items():
                    self.last_step[(name, int(w))] = int(s)
                self.rows[name] = local_store(self.weight[name], self.state[name], self.seen[name])
