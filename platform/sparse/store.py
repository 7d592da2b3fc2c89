"""Row stores: where a sparse step's embedding rows live, and how the step reads and updates them.

`step.sparse_step` asks a store for five things (``g`` is what ``gather`` returned for this batch):

- ``gather(ids [B, F]) -> Gathered``: the batch's rows split into linear weights ``w [B, F]`` and
  embeddings ``e [B, F, K - 1]`` (the backward's leaves), with what the row sums need;
- ``row_grads(g, gw, ge) -> (rows [U], grad [U, K])``: the distinct rows and their summed gradients;
- ``current(g, rows) -> [U, K]``: those rows' weights before the update (the ``l2_emb`` regulariser's);
- ``fuses_l2(rule)``: ``update`` adds ``l2 * current`` itself (the C loop, in the same pass);
- ``update(g, rows, grad, rule, l2, lr, dense_grads)``: the row rule applied (``seen`` set).

``apply(rows [U] unique, grad [U, K], rule, scale)`` is a push's update (the servers', `EmbeddingShard`),
``pull(reqs)`` the workers' client read over the store (the one-process step's validation).

Local stores (this module): `TorchRows` (any device and dtype; ``padded``: fixed shapes for
``torch.compile`` and CUDA graphs) and `CRows` (a float32 CPU table, its table work in the C loops of
`kernels`; a rule the loops do not cover, FTRL, falls back to torch). `local_store` picks one. The remote
store, rows on parameter servers, is `mariana.platform.ps.pull.RemoteRows`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import kernels, rules
from .rules import RowOptConfig, apply_rows, sum_rows


class Gathered(NamedTuple):
    """One batch's rows: ``w`` [B, F], ``e`` [B, F, K - 1]; ``rows`` [U] (or [N] slots) the distinct rows
    when known at gather; ``pos`` [B * F] each position's slot (`CRows`: the ids); ``valid`` [N] bool for
    padded slots (None: every slot a distinct row); ``pulled`` [U, K] the rows as read (remote stores)."""

    w: torch.Tensor
    e: torch.Tensor
    rows: torch.Tensor | None
    pos: torch.Tensor
    valid: torch.Tensor | None = None
    pulled: torch.Tensor | None = None


class Slots(NamedTuple):
    """``rows`` [N] table row of each slot (slots >= U repeat slot 0's); ``pos`` [B, F] the slot of each
    position of the batch; ``valid`` [N] bool, slot < U."""

    rows: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor | None
    count: torch.Tensor | int  # [] U, the number of distinct rows


def slots_of(ids: torch.Tensor) -> Slots:
    """The distinct rows of ``ids`` [B, F] (int64) padded to ``B * F`` slots, in ascending order: the
    same rows and inverse as ``torch.unique(ids, return_inverse=True)``, without its data-dependent size."""
    flat = ids.reshape(-1)
    srt, order = torch.sort(flat)
    first = torch.ones_like(srt, dtype=torch.bool)
    first[1:] = srt[1:] != srt[:-1]
    slot_sorted = torch.cumsum(first, 0) - 1  # [N] in [0, U)
    pos = torch.empty_like(slot_sorted).scatter_(0, order, slot_sorted)
    rows = srt[:1].expand(srt.shape).clone().scatter_(0, slot_sorted, srt)
    valid = torch.arange(flat.numel(), device=ids.device) <= slot_sorted[-1]
    return Slots(rows, pos.view(ids.shape), valid, slot_sorted[-1] + 1)


def row_sums(gw: torch.Tensor, ge: torch.Tensor, pos: torch.Tensor, n: int, dtype) -> torch.Tensor:
    """The rows' gradients ``[n, K]`` from the batch's ``gw [B, F]`` (linear weights) and ``ge [B, F, K - 1]``
    (embeddings), summed per slot ``pos [B * F]``. Eager: each part summed on its own, then the ``[n, K]``
    sums joined: joining the ``[B, F, K]`` gradients first costs a strided copy of every position
    (`platform/README.md`, "Measured choices"). Compiled: one sum over the joined gradients (inductor
    fuses the join into it)."""
    if torch.compiler.is_compiling():
        g = torch.cat([gw.unsqueeze(-1), ge], -1).reshape(pos.numel(), -1).to(dtype)
        return sum_rows(g, pos, n)
    w = sum_rows(gw.reshape(-1, 1).to(dtype), pos, n)
    return torch.cat([w, sum_rows(ge.reshape(pos.numel(), -1).to(dtype), pos, n)], 1)


class TorchRows:
    """A table ``weight`` [R, K] with its rule's ``state`` (name -> [R, K]) and ``seen`` [R] bool, updated
    in place with torch ops. ``padded=False``: the ``U`` distinct rows (``torch.unique``: a data-dependent
    size, which costs nothing on the CPU, and the update touches U rather than B * F rows); ``padded=True``:
    every shape fixed by the batch's (`slots_of`; the padding slots carry a zero gradient and are written at
    rows spread over the table, see `rules.apply_slots`)."""

    def __init__(
        self, weight: torch.Tensor, state: dict[str, torch.Tensor], seen: torch.Tensor, padded=False
    ):
        self.weight, self.state, self.seen, self.padded = weight, state, seen, padded

    def gather(self, ids: torch.Tensor) -> Gathered:
        if self.padded:
            s = slots_of(ids)
        else:
            rows, pos = torch.unique(ids, return_inverse=True)
            s = Slots(rows, pos, None, rows.numel())
        looked = F.embedding(ids, self.weight)  # [B, F, K]: the batch's one gather
        return Gathered(
            looked[..., 0].contiguous(), looked[..., 1:].contiguous(), s.rows, s.pos.reshape(-1), s.valid
        )

    def row_grads(self, g: Gathered, gw: torch.Tensor, ge: torch.Tensor):
        return g.rows, row_sums(gw, ge, g.pos, g.rows.numel(), self.weight.dtype)  # zeros past U

    def current(self, g: Gathered, rows: torch.Tensor) -> torch.Tensor:
        cur = self.weight.index_select(0, rows)
        return cur if g.valid is None else cur * g.valid.unsqueeze(1)  # padding slots add nothing

    def fuses_l2(self, rule: RowOptConfig) -> bool:
        return False

    def update(self, g: Gathered, rows, grad, rule: RowOptConfig, l2=0.0, lr=None, dense_grads=None) -> None:
        """The rule on ``rows`` (``lr``: a 0-d tensor instead of ``rule.lr``, the compiled step's)."""
        if g.valid is None:
            apply_rows(self.weight, self.state, rows, grad, rule, lr=lr)
        else:  # padding slots (gradient 0) spread over the table's rows: no hot spot of atomic adds
            spread = torch.where(
                g.valid, rows, torch.arange(rows.numel(), device=rows.device) % len(self.weight)
            )
            rules.apply_slots(self.weight, self.state, spread, grad, g.valid, rule, lr=lr)
        self.seen.index_fill_(0, rows, True)

    def apply(self, rows: torch.Tensor, grad: torch.Tensor, rule: RowOptConfig, scale: float = 1.0) -> None:
        apply_rows(self.weight, self.state, rows, grad, rule, scale)
        self.seen.index_fill_(0, rows, True)

    def reset(self, rows: torch.Tensor, weight: torch.Tensor, rule: RowOptConfig) -> None:
        """Start ``rows`` [E] over as new rows (a key map handed them to new keys): weights ``weight`` [E, K],
        the rule's fresh state, not ``seen``."""
        weight = weight.to(self.weight.device, self.weight.dtype)
        self.weight.index_copy_(0, rows, weight)
        for k, v in rules.init_state(rule.rule, weight, rule).items():
            self.state[k].index_copy_(0, rows, v)
        self.seen[rows] = False

    def pull(self, reqs: dict[str, torch.Tensor], step: int = -1, want_dense: bool = False):
        """The workers' client read (``reqs``: table -> rows [U]; one table here) -> (table -> [U, K], None)."""
        return {n: self.weight.index_select(0, r.to(self.weight.device)) for n, r in reqs.items()}, None


class CRows(TorchRows):
    """`TorchRows` of a float32 contiguous CPU table whose table work runs in the C loops of `kernels`:
    gather and split, the distinct rows (in order of first appearance) with their summed gradients, and for
    sgd and adagrad the update with ``l2`` fused (same numbers within Adagrad's square root's rounding,
    tests/test_cpu_rows.py)."""

    def __init__(self, weight: torch.Tensor, state: dict[str, torch.Tensor], seen: torch.Tensor):
        super().__init__(weight, state, seen)
        self.scratch: kernels.Scratch | None = None  # the loops' reused buffers (a server's store needs none)

    def gather(self, ids: torch.Tensor) -> Gathered:
        if self.scratch is None:
            self.scratch = kernels.Scratch(self.weight.shape[0])
        # the gathered rows are the backward's leaves: this step's graph is gone when the next reuses them
        w0, e0 = kernels.gather_split(self.weight, ids, self.scratch)
        return Gathered(w0, e0, None, ids)

    def row_grads(self, g: Gathered, gw: torch.Tensor, ge: torch.Tensor):
        return kernels.unique_sum(g.pos, gw.to(self.weight.dtype), ge.to(self.weight.dtype), self.scratch)

    def fuses_l2(self, rule: RowOptConfig) -> bool:
        return rule.rule in kernels.RULE_CODES

    def update(self, g: Gathered, rows, grad, rule: RowOptConfig, l2=0.0, lr=None, dense_grads=None) -> None:
        if rule.rule not in kernels.RULE_CODES or lr is not None:
            return super().update(g, rows, grad, rule, l2, lr)
        kernels.update_rows(
            self.weight, self.state.get("acc"), self.seen, rows, grad, rule.rule, rule.lr, rule.eps, l2
        )

    def apply(self, rows: torch.Tensor, grad: torch.Tensor, rule: RowOptConfig, scale: float = 1.0) -> None:
        if rule.rule not in kernels.RULE_CODES:
            return super().apply(rows, grad, rule, scale)
        g = grad.to(torch.float32).contiguous()
        g = g * scale if scale != 1.0 else g
        kernels.update_rows(
            self.weight, self.state.get("acc"), self.seen, rows, g, rule.rule, rule.lr, rule.eps
        )


def local_store(weight: torch.Tensor, state: dict[str, torch.Tensor], seen: torch.Tensor, padded=False):
    """`CRows` where the C loops apply (a float32 contiguous CPU table, the library built, not padded),
    else `TorchRows`."""
    if not padded and kernels.usable(weight, seen, *state.values()):
        return CRows(weight, state, seen)
    return TorchRows(weight, state, seen, padded)
