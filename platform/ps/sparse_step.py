"""The one-process sparse step at fixed shapes: no host reads, no data-dependent sizes.

A batch's ids ``[B, F]`` become ``N = B * F`` *slots* by a sort: slot ``s < U`` holds the ``s``-th
smallest distinct id, slots ``>= U`` repeat slot 0's row (the padding). Every tensor of the step then has
a shape fixed by ``(B, F, K)``, so the whole step (one gather, forward and backward through
``torch.func``, the per-row gradient sum, the row optimiser's read-modify-write) compiles with
``torch.compile(fullgraph=True)`` and can be captured in a CUDA graph.

The padding slots carry a zero gradient and the row optimiser adds their change (exactly 0) with
``index_add_`` (`rowopt.apply_slots`) at rows spread over the table (slot ``s`` -> row ``s mod R``: no hot
spot of atomic adds): a compiler that fuses each slot's read of a row into its write (inductor does) then
cannot update a row twice, whatever order the slots run in. The new table equals the one the unique-row
step (``torch.unique`` + ``apply_rows``) gives within rounding (``w + (new - w)`` against ``new``; the
gradient sums run over the same positions in the same order).

The model is any object with ``forward_parts(w [B, F], e [B, F, K - 1], vals [B, F] or None,
dense [B, D]) -> logits [B]`` whose dense parameters are ``named_dense`` (the protocol of
`mariana.platform.ps`'s steps).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value

from . import cpu_rows
from .rowopt import RowOptConfig, apply_rows, apply_slots, sum_rows


def row_sums(gw: torch.Tensor, ge: torch.Tensor, pos: torch.Tensor, n: int, dtype) -> torch.Tensor:
    """The rows' gradients ``[n, K]`` from the batch's ``gw [B, F]`` (linear weights) and ``ge [B, F, K - 1]``
    (embeddings), summed per slot ``pos [B * F]``. Eager: each part summed on its own, then the ``[n, K]``
    sums joined (the PS worker's order of work, the same numbers): joining the ``[B, F, K]`` gradients first
    costs a strided copy of every position (`platform/README.md`, "Measured choices"). Compiled:
    one sum over the joined gradients (inductor fuses the join into it)."""
    if torch.compiler.is_compiling():
        g = torch.cat([gw.unsqueeze(-1), ge], -1).reshape(pos.numel(), -1).to(dtype)
        return sum_rows(g, pos, n)
    w = sum_rows(gw.reshape(-1, 1).to(dtype), pos, n)
    return torch.cat([w, sum_rows(ge.reshape(pos.numel(), -1).to(dtype), pos, n)], 1)


class Slots(NamedTuple):
    """``rows`` [N] table row of each slot (slots >= U repeat slot 0's); ``pos`` [B, F] the slot of each
    position of the batch; ``valid`` [N] bool, slot < U."""

    rows: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor
    count: torch.Tensor  # [] U, the number of distinct rows


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


def unique_slots(ids: torch.Tensor) -> Slots:
    """`slots_of` without the padding (``U`` slots, ``valid`` None), through ``torch.unique``: its size
    depends on the data, which costs nothing on the CPU (faster there than ``torch.sort``)."""
    rows, pos = torch.unique(ids, return_inverse=True)
    return Slots(rows, pos, None, rows.numel())


class _Parts(nn.Module):
    """Calls ``model.forward_parts`` through ``forward``, for ``torch.func.functional_call``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.m = model

    def forward(self, w, e, vals, dense):
        return self.m.forward_parts(w, e, vals, dense)


@torch.no_grad()
def clip_(grads: list[torch.Tensor], max_norm: float) -> None:
    """Scale ``grads`` in place so that their joint L2 norm is at most ``max_norm`` (as
    ``torch.nn.utils.clip_grad_norm_`` does for parameters)."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))


class FixedShapeStep:
    """The row part and gradients of one step of ``model`` whose rows live in ``weight`` [R, K] (with the
    row optimiser's ``state`` [R, K] tensors and ``seen`` [R] bool), in place.

    ``__call__(ids [B, F], vals [B, F], dense [B, D], labels [B], row_opt) -> (loss [], dense grads)``:
    the batch's rows are gathered once, the loss's gradient taken with ``torch.func``, summed per row,
    regularised (``l2_emb``), clipped jointly with the dense gradients (``clip_grad``) and applied to the
    rows by ``row_opt``; the dense gradients (``weight_decay`` added) come back in ``dense_parameters``
    order for the caller's optimiser. ``unit_vals``: every value of the data set is 1 (decided once per
    data set), so the two products with ``vals`` are skipped (multiplying by 1 is exact: same result).

    ``trim`` (default: a table on the CPU): the ``U`` distinct rows only (``torch.unique``): on the CPU a
    data-dependent size costs nothing and the row update then touches ``U`` rather than ``B * F`` rows
    (power-law ids: U is a fraction of B * F). On a GPU, and under ``torch.compile``, ``trim=False``:
    every shape stays fixed. Both give the same numbers (tests/test_ps_fixed_step.py). A trimmed step on a
    float32 CPU table does its table work (gather, distinct rows + per-row sums, row update) in the C
    loops of `cpu_rows` when they are built (`cpu_step`; same numbers within Adagrad's square root's
    rounding, tests/test_cpu_rows.py)."""

    def __init__(
        self,
        model: nn.Module,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        seen: torch.Tensor,
        *,
        unit_vals: bool = False,
        autocast=None,
        clip_grad: float = 0.0,
        l2_emb: float = 0.0,
        weight_decay: float = 0.0,
        trim: bool | None = None,
    ):
        self.model, self.parts = model, _Parts(model)
        self.weight, self.state, self.seen = weight, state, seen
        self.unit_vals, self.autocast = unit_vals, autocast
        self.clip_grad, self.l2_emb, self.weight_decay = clip_grad, l2_emb, weight_decay
        self.names = [n for n, p in model.named_parameters() if not n.startswith("table.")]
        self.trim = weight.device.type == "cpu" if trim is None else trim
        self.used: set[str] | None = None  # the dense parameters the forward reaches (first call)
        self.compiled = None  # `compile`: the step through torch.compile
        self.graphs = False  # the compiled step replays CUDA graphs
        self.lr = None  # [] the row optimiser's learning rate as data, when compiled
        self.params: dict[str, torch.Tensor] = {}  # m.<name> -> the dense parameters, detached
        self.scratch: cpu_rows.Scratch | None = None  # `cpu_step`'s buffers, made at its first call

    def compile(self, backend: str = "inductor", mode: str | None = None) -> None:
        """Run the step through ``torch.compile(fullgraph=True, backend=backend, mode=mode)`` from now on
        (every shape fixed: ``trim`` off). The learning rate reaches the graph as the 0-d tensor
        ``self.lr`` (filled before each call), so a schedule does not recompile it.

        ``mode="reduce-overhead"`` (inductor on CUDA): the graph is captured in a CUDA graph and replayed.
        The tensors it updates in place (table, row-optimiser state, ``seen``), the learning rate and the
        dense parameters are marked static (fixed addresses: the replay reads and writes them where they
        are; only the batch is copied in). A replay overwrites the previous call's outputs (loss and dense
        gradients): the caller consumes them before the next call (`pull.apply_dense` steps the dense
        optimiser at once), and each call starts a new step (``cudagraph_mark_step_begin``)."""
        self.trim = False
        self.lr = torch.zeros((), dtype=self.weight.dtype, device=self.weight.device)
        self.graphs = mode == "reduce-overhead"
        if self.graphs:
            for t in (self.weight, self.seen, self.lr, *self.state.values()):
                torch._dynamo.mark_static_address(t)
        self.params = {}
        self.compiled = torch.compile(self.step, fullgraph=True, backend=backend, mode=mode)

    def __call__(self, ids, vals, dense, labels, row_opt: RowOptConfig):
        if self.used is None:
            self.used = self.used_parameters(ids[:1], vals[:1], dense[:1])
        params = self.dense_values()
        if self.compiled is None:
            return self.step(params, ids, vals, dense, labels, row_opt)
        self.lr.fill_(row_opt.lr)  # a kernel argument, no host read; the graph reads the tensor
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return self.compiled(params, ids, vals, dense, labels, row_opt, self.lr)

    def dense_values(self) -> dict[str, torch.Tensor]:
        """``m.<name>`` -> the dense parameters, detached (aliases: the optimiser's in-place updates show
        through). Kept between calls, so that a compiled step meets the same tensors each time (static
        addresses under CUDA graphs); made anew if a parameter's storage moved (e.g. ``model.to``)."""
        named = dict(self.model.named_parameters())
        if len(self.params) != len(self.names) or any(
            t.data_ptr() != named[k[2:]].data_ptr() for k, t in self.params.items()
        ):
            self.params = {f"m.{n}": named[n].detach() for n in self.names}
            if self.graphs:
                for t in self.params.values():
                    torch._dynamo.mark_static_address(t)
        return self.params

    def used_parameters(self, ids, vals, dense) -> set[str]:
        """The dense parameters the forward reaches (autograd on a one-sample batch, once): the others get
        no gradient (``None``), as with ``loss.backward()``, so that their optimiser leaves them alone."""
        rows = F.embedding(ids, self.weight).detach()
        with torch.random.fork_rng(devices=[]):  # a dropout here must not move the training's RNG
            out = self.model.forward_parts(rows[..., 0], rows[..., 1:], vals, dense)
        params = [p for n, p in self.model.named_parameters() if n in self.names]
        grads = torch.autograd.grad(out.sum(), params, allow_unused=True)
        return {n for n, g in zip(self.names, grads) if g is not None}

    def autograd_grads(self, w0, e0, vals, dense, labels):
        """The eager backward: (dense gradients ``m.<name>`` -> [..], d loss / d w [B, F], d loss / d e
        [B, F, K - 1], loss []) with ``torch.autograd`` over the live parameters."""
        w, e = w0.requires_grad_(True), e0.requires_grad_(True)
        named = dict(self.model.named_parameters())
        used = [n for n in self.names if n in self.used]
        with self.autocast() if self.autocast is not None else contextlib.nullcontext():
            logits = self.model.forward_parts(w, e, vals, dense)
        loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
        grads = torch.autograd.grad(loss, [w, e, *(named[n] for n in used)], allow_unused=True)
        gw, ge = (torch.zeros_like(t) if g is None else g for g, t in zip(grads[:2], (w, e)))
        return {f"m.{n}": g for n, g in zip(used, grads[2:])}, gw, ge, loss

    def step(self, params: dict[str, torch.Tensor], ids, vals, dense, labels, row_opt: RowOptConfig, lr=None):
        """The whole step as one function of tensors (what ``torch.compile(fullgraph=True)`` takes);
        ``params``: ``m.<name>`` -> the dense parameters' values; ``lr``: None (``row_opt.lr``) or a 0-d
        tensor on the table's device used instead (see `rowopt.apply_rows`). Returns (loss [], dense
        gradients in ``names`` order, None for a parameter the forward does not reach)."""
        if (
            self.trim
            and self.compiled is None
            and cpu_rows.usable(self.weight, self.seen, *self.state.values())
        ):
            return self.cpu_step(params, ids, vals, dense, labels, row_opt)
        weight = self.weight
        slots = unique_slots(ids) if self.trim else slots_of(ids)
        N = slots.rows.numel()
        looked = F.embedding(ids, weight)  # [B, F, K]: the batch's one gather
        w0, e0 = looked[..., 0].contiguous(), looked[..., 1:].contiguous()
        v = None if self.unit_vals else vals
        trained = {k: t for k, t in params.items() if k[2:] in self.used}
        rest = {k: t for k, t in params.items() if k[2:] not in self.used}

        def loss_fn(p, w, e):
            with self.autocast() if self.autocast is not None else contextlib.nullcontext():
                logits = functional_call(self.parts, {**rest, **p}, (w, e, v, dense))
            return F.binary_cross_entropy_with_logits(logits.float(), labels)

        if torch.compiler.is_compiling():  # one graph: the backward through torch.func
            (gp, gw, ge), loss = grad_and_value(loss_fn, argnums=(0, 1, 2))(trained, w0, e0)
        else:  # eager: autograd, bit for bit the parameter-server worker's gradients
            gp, gw, ge, loss = self.autograd_grads(w0, e0, v, dense, labels)
        rows, valid = slots.rows, slots.valid
        if self.trim:  # the U distinct rows only (see the class docstring)
            N = rows.numel()
        row_grad = row_sums(gw, ge, slots.pos.reshape(-1), N, weight.dtype)  # [N, K], zeros past U
        if self.l2_emb > 0:  # once per distinct row: the padding slots add nothing here
            current = weight.index_select(0, rows)  # [N, K]
            row_grad.add_(current if valid is None else current * valid.unsqueeze(1), alpha=self.l2_emb)
        dense_grads = self.dense_grads(params, gp)
        if self.clip_grad > 0:
            clip_([row_grad, *(g for g in dense_grads if g is not None)], self.clip_grad)
        if valid is None:  # the U distinct rows
            apply_rows(weight, self.state, rows, row_grad, row_opt, lr=lr)
        else:  # padding slots (gradient 0) spread over the table's rows: see the module docstring
            spread = torch.where(valid, rows, torch.arange(N, device=rows.device) % weight.shape[0])
            apply_slots(weight, self.state, spread, row_grad, valid, row_opt, lr=lr)
        self.seen.index_fill_(0, rows, True)
        return loss.detach(), dense_grads

    def dense_grads(self, params: dict[str, torch.Tensor], gp: dict[str, torch.Tensor]) -> list:
        """The dense gradients in ``names`` order (None: not reached), ``weight_decay * p`` added."""
        grads = [gp.get(f"m.{n}") for n in self.names]
        if self.weight_decay > 0:
            for i, n in enumerate(self.names):
                p = params[f"m.{n}"]
                if grads[i] is None:
                    grads[i] = p * self.weight_decay
                else:
                    grads[i].add_(p, alpha=self.weight_decay)
        return grads

    def cpu_step(self, params: dict[str, torch.Tensor], ids, vals, dense, labels, row_opt: RowOptConfig):
        """`step`'s trimmed eager path with the table work in `cpu_rows`' C loops (float32 table on the
        CPU): gather and split the rows, autograd, the distinct rows in order of first appearance with
        their summed gradients, ``l2_emb``, clipping, the row update. Same returns as `step`."""
        weight = self.weight
        if self.scratch is None:
            self.scratch = cpu_rows.Scratch(weight.shape[0])
        # the gathered rows are the backward's leaves: this step's graph is gone when the next reuses them
        w0, e0 = cpu_rows.gather_split(weight, ids, self.scratch)
        v = None if self.unit_vals else vals
        gp, gw, ge, loss = self.autograd_grads(w0, e0, v, dense, labels)
        rows, row_grad = cpu_rows.unique_sum(ids, gw.to(weight.dtype), ge.to(weight.dtype), self.scratch)
        dense_grads = self.dense_grads(params, gp)
        # l2_emb inside the C update, unless clipping's norm must include it first or the rule is not in C
        fused_l2 = row_opt.rule in cpu_rows.RULE_CODES and self.clip_grad == 0
        if self.l2_emb > 0 and not fused_l2:
            row_grad.add_(weight.index_select(0, rows), alpha=self.l2_emb)
        if self.clip_grad > 0:
            clip_([row_grad, *(g for g in dense_grads if g is not None)], self.clip_grad)
        if row_opt.rule in cpu_rows.RULE_CODES:
            acc = self.state.get("acc", weight)  # sgd has no accumulator: any float32 [R, K] tensor
            l2 = self.l2_emb if fused_l2 else 0.0
            cpu_rows.update_rows(
                weight, acc, self.seen, rows, row_grad, row_opt.rule, row_opt.lr, row_opt.eps, l2
            )
        else:
            apply_rows(weight, self.state, rows, row_grad, row_opt)
            self.seen.index_fill_(0, rows, True)
        return loss.detach(), dense_grads
