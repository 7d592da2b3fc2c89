"""The sparse step math of the parameter-server framework: pull a batch's unique rows (from a local shard
or from the servers), run the model on them, push exactly those rows' gradients.

`train_step` is the step of a parameter-server worker (and the reference the fixed-shape one-process
step, `FixedShapeStep`, is tested against); `local_step`/`apply_dense` run `FixedShapeStep` on an
in-process shard; `predict_batches` scores batches through any client. Models, batches and settings are
the application's (`protocol.py`).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..core.rundir import RunDir
from .dense import flatten, unflatten_into
from .protocol import TABLE, SparseBatch, SparseModel
from .rowopt import sum_rows
from .sparse_step import FixedShapeStep, clip_
from .worker import LocalClient

__all__ = [
    "TABLE",
    "Done",
    "Pulled",
    "apply_dense",
    "fresh_rows",
    "gather_rows",
    "local_step",
    "predict_batches",
]


class Pulled(NamedTuple):
    """A batch whose rows' pull is in flight: ``uniq`` [U] its unique ids, ``inv`` [B, F] their inverse,
    ``pending.wait()`` -> (table -> rows [U, K], dense flat [P] or None)."""

    batch: SparseBatch
    uniq: torch.Tensor
    inv: torch.Tensor
    pending: Any


def send_pull(client, batch: SparseBatch, step: int, want_dense: bool = False) -> Pulled:
    """Start pulling the unique rows of ``batch.ids [B, F]`` (and the dense parameters) for ``step``."""
    uniq, inv = torch.unique(batch.ids, return_inverse=True)
    return Pulled(batch, uniq, inv, client.pull_async({TABLE: uniq}, step, want_dense))


def fresh_rows(seed: int, init_std: float, n: int, width: int, step: int, worker: int = 0) -> torch.Tensor:
    """Weights [n, width] for ``n`` rows that `--ids dynamic` evicted at ``step``: N(0, init_std), linear
    weight (column 0) 0, as a new table's rows. Seeded by (seed, step), and the worker on parameter-server
    workers other than 0, so that a resumed run, and worker 0 of a one-worker job, redraw exactly what one
    process draws."""
    seed = seed * 7919 + 104729 + step + (worker * 1_000_003 if worker else 0)
    fresh = torch.randn(n, width, generator=torch.Generator().manual_seed(seed)) * init_std
    fresh[:, 0] = 0.0
    return fresh


class Done:
    """An answer already at hand, with a future's ``wait()``."""

    def __init__(self, result):
        self.result = result

    def wait(self):
        return self.result


def gather_rows(client, ids: torch.Tensor, step: int, device, want_dense: bool = False, pulled=None):
    """Pull the unique rows of ``ids [B, F]``: (unique ids [U], inverse [B, F], rows leaf [U, K], dense).
    ``pulled``: a `Pulled` of the same batch sent earlier, whose rows are used instead."""
    if pulled is not None:
        uniq, inv = pulled.uniq, pulled.inv
        rows_by_table, dense = pulled.pending.wait()
    else:
        uniq, inv = torch.unique(ids, return_inverse=True)
        rows_by_table, dense = client.pull({TABLE: uniq}, step, want_dense)
    rows = rows_by_table[TABLE].to(device, non_blocking=True)
    return uniq, inv, rows, dense


def train_step(
    model: SparseModel,
    client,
    batch: SparseBatch,
    step: int,
    device,
    dense_opt=None,
    remote_dense=False,
    autocast=None,
    clip_grad: float = 0.0,
    l2_emb: float = 0.0,
    weight_decay: float = 0.0,
    pulled: Pulled | None = None,
):
    """One pull -> forward/backward -> push. Returns the mean log-loss (float tensor). ``pulled``: this
    batch's pull, sent ahead (`send_pull`).

    ``l2_emb > 0`` adds ``l2_emb * row`` to the gradient of every row the batch looks up (once per unique
    row, whatever its count in the batch): the gradient of ``(l2_emb / 2) * ||row||^2`` over the batch's
    rows. ``weight_decay > 0`` adds ``weight_decay * p`` to the gradient of every dense parameter (the
    gradient of ``(weight_decay / 2) * ||p||^2``, coupled L2 as FuxiCTR's ``net_regularizer``). Both are
    added before ``clip_grad`` and the optimisers, on workers exactly as in one process.

    ``clip_grad > 0`` scales the step's whole gradient (dense parameters and the batch's rows together)
    so that its L2 norm is at most ``clip_grad``.

    The batch's looked-up rows enter autograd as two leaves, ``w [B, F]`` and ``e [B, F, dim]``; their
    gradients are summed per unique row (`rowopt.sum_rows`) into ``[U, 1 + dim]`` (cheaper on CPU than
    the embedding backward over a ``[U, K]`` leaf). ``autocast`` (a context factory) wraps the forward."""
    if isinstance(client, LocalClient) and not remote_dense and pulled is None:  # the fixed-shape step
        loss, _ = local_step(model, client.shard, batch, dense_opt, autocast, clip_grad, l2_emb, weight_decay)
        return loss
    uniq, inv, rows, dense_flat = gather_rows(client, batch.ids, step, device, remote_dense, pulled)
    if remote_dense and dense_flat is not None:
        unflatten_into(dense_flat, model.dense_parameters())
    w = rows[:, 0][inv].requires_grad_(True)  # [B, F]
    e = F.embedding(inv, rows[:, 1:].contiguous()).requires_grad_(True)  # [B, F, dim]
    with autocast() if autocast is not None else contextlib.nullcontext():
        vals = None if bool((batch.vals == 1).all()) else batch.vals  # one-hot data: skip the products
        logits = model.forward_parts(w, e, vals, batch.dense)
    loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels)
    params = model.dense_parameters()
    for p in params:
        p.grad = None
    loss.backward()
    flat_inv = inv.reshape(-1)
    U = rows.shape[0]

    def per_row(g, width):  # [B, F(, d)] -> [U, width], summed over repeats (zeros if unused)
        if g is None:
            return rows.new_zeros(U, width)
        return sum_rows(g.reshape(flat_inv.numel(), width), flat_inv, U)

    row_grad = torch.cat([per_row(w.grad, 1), per_row(e.grad, rows.shape[1] - 1)], 1)
    if l2_emb > 0:
        row_grad.add_(rows, alpha=l2_emb)
    if weight_decay > 0:
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    p.grad = p.detach() * weight_decay
                else:
                    p.grad.add_(p.detach(), alpha=weight_decay)
    if clip_grad > 0:
        clip_([row_grad, *(p.grad for p in params if p.grad is not None)], clip_grad)
    dense_grad = None
    if remote_dense:
        dense_grad = flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in params]).cpu()
    client.push({TABLE: (uniq, row_grad)}, dense_grad, step)
    if dense_opt is not None:
        dense_opt.step()
    return loss.detach()


def local_step(
    model,
    shard,
    batch: SparseBatch,
    dense_opt,
    autocast=None,
    clip_grad=0.0,
    l2_emb=0.0,
    weight_decay=0.0,
    unit_vals: bool = False,
):
    """`train_step` on an in-process shard through `FixedShapeStep` (the one-process step):
    (loss [], the step object)."""
    fixed = FixedShapeStep(
        model,
        shard.weight[TABLE],
        shard.state[TABLE],
        shard.seen[TABLE],
        unit_vals=unit_vals,
        autocast=autocast,
        clip_grad=clip_grad,
        l2_emb=l2_emb,
        weight_decay=weight_decay,
    )
    return apply_dense(fixed, batch, shard.opt, dense_opt), fixed


def apply_dense(fixed: FixedShapeStep, batch: SparseBatch, row_opt, dense_opt) -> torch.Tensor:
    """Run ``fixed`` on ``batch`` (its rows updated in place), hand the dense gradients to the model's
    parameters and step ``dense_opt`` (if any). Returns the loss []."""
    loss, grads = fixed(batch.ids, batch.vals, batch.dense, batch.labels, row_opt)
    for p, g in zip(fixed.model.dense_parameters(), grads):
        p.grad = g
    if dense_opt is not None:
        dense_opt.step()
    return loss


@torch.no_grad()
def predict_batches(
    model: SparseModel, batches, client, device, seen=None, rows_per_field=None, idmap=None
) -> np.ndarray:
    """Probabilities for each batch (rows from ``client``; unseen rows -> OOV row if ``seen`` given;
    ``idmap``: `--ids dynamic`'s map, whose read-only lookup turns the batch's keys into rows)."""
    model.eval()
    out = []
    for b in batches:
        b = b.to(device)
        ids = b.ids
        if idmap is not None:
            ids = torch.from_numpy(idmap.lookup(ids.cpu().numpy())).to(device)
        if seen is not None:
            ids = torch.where(seen[ids], ids, ids - ids % rows_per_field)
        uniq, inv, rows, _ = gather_rows(client, ids, -1, device)
        out.append(torch.sigmoid(model.forward_rows(F.embedding(inv, rows), b.vals, b.dense)).float().cpu())
    model.train()
    return torch.cat(out).numpy() if out else np.zeros(0, dtype=np.float32)


def write_counter(run: RunDir, worker: int, rec: dict) -> None:
    """Append one record to ``RUN/counters/worker-W.jsonl`` (the job service and the web UI read them)."""
    d = run.path / "counters"
    d.mkdir(exist_ok=True)
    with open(d / f"worker-{worker}.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
