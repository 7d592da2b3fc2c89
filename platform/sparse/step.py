"""The sparse step, written once: gather the batch's rows from a row store, forward/backward, per-row
gradient sums, ``l2_emb``, weight decay, clipping, the row update (`sparse_step`); and `SparseStep`, the
one-process step over a local store, eager or compiled at fixed shapes.

Every caller runs `sparse_step` (`local.LocalStep` through `SparseStep`, the parameter-server workers'
`ps.pull.train_step` over `RemoteRows`); the store decides the table work (`store.py`), the math is this.

Compiled (`SparseStep.compile`), the step runs on a padded `TorchRows`: the batch's ids ``[B, F]`` become
``N = B * F`` slots (`store.slots_of`), so every tensor has a shape fixed by ``(B, F, K)`` and the whole
step (one gather, forward and backward through ``torch.func``, the per-row sum, the rule's
read-modify-write) compiles with ``torch.compile(fullgraph=True)`` and can be captured in a CUDA graph.

The model is any object with ``forward_parts(w [B, F], e [B, F, K - 1], vals [B, F] or None,
dense [B, D]) -> logits [B]`` whose dense parameters are those not named ``table.*`` (the protocol of
`mariana.platform.ps`'s steps, `protocol.SparseModel`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value

from .rules import RowOptConfig
from .store import TorchRows, local_store


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


def dense_names(model: nn.Module) -> list[str]:
    """The dense parameters' names, in ``model.dense_parameters()`` order (everything but ``table.*``)."""
    return [n for n, _ in model.named_parameters() if not n.startswith("table.")]


def _grads(model, compiled, w0, e0, vals, dense, labels, autocast):
    """(dense gradients by name, d loss / d w [B, F], d loss / d e [B, F, K - 1], loss []). Eager (``params``
    None): ``torch.autograd`` over the live parameters, None for one the forward does not reach (its
    optimiser then leaves it alone, as with ``loss.backward()``). Compiled (``compiled``: (``_Parts(model)``,
    ``m.<name>`` -> value, the names the forward reaches)): ``torch.func`` over those, one graph."""
    amp = autocast if autocast is not None else contextlib.nullcontext
    if compiled is not None and torch.compiler.is_compiling():
        parts, params, used = compiled
        trained = {k: t for k, t in params.items() if k[2:] in used}
        rest = {k: t for k, t in params.items() if k[2:] not in used}

        def loss_fn(p, w, e):
            with amp():
                logits = functional_call(parts, {**rest, **p}, (w, e, vals, dense))
            return F.binary_cross_entropy_with_logits(logits.float(), labels)

        (gp, gw, ge), loss = grad_and_value(loss_fn, argnums=(0, 1, 2))(trained, w0, e0)
        return {k[2:]: g for k, g in gp.items()}, gw, ge, loss
    w, e = w0.requires_grad_(True), e0.requires_grad_(True)
    named = [(n, p) for n, p in model.named_parameters() if not n.startswith("table.") and p.requires_grad]
    with amp():
        logits = model.forward_parts(w, e, vals, dense)
    loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
    grads = torch.autograd.grad(loss, [w, e, *(p for _, p in named)], allow_unused=True)
    gw, ge = (torch.zeros_like(t) if g is None else g for g, t in zip(grads[:2], (w, e)))
    return {n: g for (n, _), g in zip(named, grads[2:]) if g is not None}, gw, ge, loss


def sparse_step(
    model: nn.Module,
    store,
    ids: torch.Tensor,
    vals: torch.Tensor | None,
    dense: torch.Tensor,
    labels: torch.Tensor,
    rule: RowOptConfig,
    *,
    autocast=None,
    clip_grad: float = 0.0,
    l2_emb: float = 0.0,
    weight_decay: float = 0.0,
    compiled: tuple | None = None,
    lr: torch.Tensor | None = None,
):
    """One step of ``model`` on a batch (``ids`` [B, F] rows of ``store``, ``vals`` [B, F] or None: all 1,
    ``dense`` [B, D], ``labels`` [B]), its rows updated by ``store`` with ``rule``. Returns (loss [], dense
    gradients in ``dense_parameters()`` order, None for a parameter the forward does not reach); the caller
    steps its dense optimiser with them (a remote store pushed them with the rows).

    ``l2_emb > 0`` adds ``l2_emb * row`` to the gradient of every row the batch looks up, once per distinct
    row (the gradient of ``(l2_emb / 2) * ||row||^2``); ``weight_decay > 0`` adds ``weight_decay * p`` to
    every dense parameter's (coupled L2, as FuxiCTR's ``net_regularizer``); ``clip_grad > 0`` then scales
    the rows' and the dense gradients together to an L2 norm of at most ``clip_grad``. ``autocast``: a
    context factory around the forward. ``compiled``/``lr``: the compiled step's (`SparseStep.step`)."""
    g = store.gather(ids)
    gp, gw, ge, loss = _grads(model, compiled, g.w, g.e, vals, dense, labels, autocast)
    params = compiled[1] if compiled is not None else None
    rows, row_grad = store.row_grads(g, gw, ge)
    # the dense parameters' values by name, in dense_parameters() order (``params``: already in it)
    live = {k[2:]: v for k, v in params.items()} if params is not None else dict(model.named_parameters())
    names = list(live) if params is not None else dense_names(model)
    dense_grads = [gp.get(n) for n in names]
    if weight_decay > 0:
        for i, n in enumerate(names):
            p, d = live[n].detach(), dense_grads[i]
            dense_grads[i] = p * weight_decay if d is None else d.add_(p, alpha=weight_decay)
    fused = l2_emb > 0 and clip_grad == 0 and store.fuses_l2(rule)  # added inside the store's update
    if l2_emb > 0 and not fused:
        row_grad.add_(store.current(g, rows), alpha=l2_emb)
    if clip_grad > 0:
        clip_([row_grad, *(d for d in dense_grads if d is not None)], clip_grad)
    store.update(g, rows, row_grad, rule, l2_emb if fused else 0.0, lr, dense_grads)
    return loss.detach(), dense_grads


class SparseStep:
    """The one-process step of ``model`` over a local table ``weight`` [R, K] (with the rule's ``state`` and
    ``seen`` [R] bool), updated in place: `local_store`'s store (the C loops on a float32 CPU table;
    ``trim=False``: a padded `TorchRows`, every shape fixed).

    ``__call__(ids [B, F], vals [B, F], dense [B, D], labels [B], rule) -> (loss [], dense grads)``;
    ``unit_vals``: every value of the data set is 1 (decided once per data set), so the two products with
    ``vals`` are skipped (multiplying by 1 is exact: same result)."""

    def __init__(
        self, model: nn.Module, weight, state, seen, *, unit_vals=False, autocast=None, trim=None, **reg
    ):
        """``reg``: ``clip_grad``, ``l2_emb``, ``weight_decay`` (as `sparse_step`'s)."""
        self.model, self.unit_vals, self.autocast, self.reg = model, unit_vals, autocast, reg
        self.parts = _Parts(model)
        self.weight, self.state, self.seen = weight, state, seen
        trim = weight.device.type == "cpu" if trim is None else trim
        self.store = local_store(weight, state, seen, padded=not trim)
        self.names = dense_names(model)
        self.used: set[str] | None = None  # the dense parameters the forward reaches (compiled: first call)
        self.compiled = None  # `compile`: the step through torch.compile
        self.graphs = False  # the compiled step replays CUDA graphs
        self.lr = None  # [] the row optimiser's learning rate as data, when compiled
        self.params: dict[str, torch.Tensor] = {}  # m.<name> -> the dense parameters, detached

    def compile(self, backend: str = "inductor", mode: str | None = None) -> None:
        """Run the step through ``torch.compile(fullgraph=True, backend=backend, mode=mode)`` from now on
        (a padded store); the learning rate is the 0-d tensor ``self.lr``, so a schedule does not recompile.
        ``mode="reduce-overhead"``: a CUDA graph, replayed; the tensors it updates in place, ``lr`` and the
        dense parameters are marked static (only the batch is copied in). A replay overwrites the previous
        call's loss and dense gradients: the caller consumes them first (`apply_dense`)."""
        self.store = TorchRows(self.weight, self.state, self.seen, padded=True)
        self.lr = torch.zeros((), dtype=self.weight.dtype, device=self.weight.device)
        self.graphs = mode == "reduce-overhead"
        if self.graphs:
            for t in (self.weight, self.seen, self.lr, *self.state.values()):
                torch._dynamo.mark_static_address(t)
        self.params = {}
        self.compiled = torch.compile(self.step, fullgraph=True, backend=backend, mode=mode)

    def __call__(self, ids, vals, dense, labels, rule: RowOptConfig):
        params = self.dense_values()
        if self.compiled is None:
            return self.step(params, ids, vals, dense, labels, rule)
        if self.used is None:
            self.used = self.used_parameters(ids[:1], vals[:1], dense[:1])
        self.lr.fill_(rule.lr)  # a kernel argument, no host read; the graph reads the tensor
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return self.compiled(params, ids, vals, dense, labels, rule, self.lr)

    def step(self, params: dict[str, torch.Tensor], ids, vals, dense, labels, rule: RowOptConfig, lr=None):
        """The whole step as one function of tensors (what ``torch.compile(fullgraph=True)`` takes);
        ``params``: ``m.<name>`` -> the dense parameters' values; ``lr``: None (``rule.lr``) or a 0-d
        tensor used instead. Returns `sparse_step`'s."""
        v = None if self.unit_vals else vals
        return sparse_step(
            self.model, self.store, ids, v, dense, labels, rule, autocast=self.autocast,
            compiled=(self.parts, params, self.used), lr=lr, **self.reg,
        )  # fmt: skip

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
        """The dense parameters the forward reaches (autograd on a one-sample batch, once): the compiled
        step differentiates only those, so that the others get no gradient (None) as in the eager step."""
        rows = F.embedding(ids, self.weight).detach()
        with torch.random.fork_rng(devices=[]):  # a dropout here must not move the training's RNG
            out = self.model.forward_parts(rows[..., 0], rows[..., 1:], vals, dense)
        params = [p for n, p in self.model.named_parameters() if n in self.names]
        grads = torch.autograd.grad(out.sum(), params, allow_unused=True)
        return {n for n, g in zip(self.names, grads) if g is not None}


def step_dense(model: nn.Module, grads: list, dense_opt) -> None:
    """Hand a step's dense gradients (`sparse_step`'s) to ``model``'s dense parameters and step
    ``dense_opt`` (if any)."""
    for p, g in zip(model.dense_parameters(), grads):
        p.grad = g
    if dense_opt is not None:
        dense_opt.step()


def apply_dense(step: SparseStep, batch, rule: RowOptConfig, dense_opt) -> torch.Tensor:
    """Run ``step`` on ``batch`` (its rows updated in place), then `step_dense`. Returns the loss []."""
    loss, grads = step(batch.ids, batch.vals, batch.dense, batch.labels, rule)
    step_dense(step.model, grads, dense_opt)
    return loss
