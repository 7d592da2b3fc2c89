"""The parameter-server worker's side of the sparse step: `RemoteRows`, the row store whose rows live on
the servers (pull a batch's unique rows, push exactly those rows' gradients with the dense ones), and
`train_step`, the one sparse step (`mariana.platform.sparse.step.sparse_step`) over it; `predict_batches` scores batches through any client. Models, batches and
settings are the application's (`protocol.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..core.rundir import RunDir
from ..sparse.step import sparse_step, step_dense
from ..sparse.store import Gathered, row_sums
from .dense import flatten, unflatten_into
from .protocol import TABLE, SparseBatch, SparseModel


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


class RemoteRows:
    """The row store (`mariana.platform.sparse.store`'s calls) of one worker step whose rows live behind
    ``client`` (a `PSClient`, or an in-process shard's client with its pull/push): ``gather`` pulls the batch's unique
    rows (or takes ``pulled``, sent ahead) and, with ``remote_dense``, the dense parameters into ``model``;
    ``update`` pushes the rows' gradients (and the dense ones, flat) for ``step``; the servers apply them."""

    def __init__(
        self, client, step: int, device, model=None, remote_dense=False, pulled: Pulled | None = None
    ):
        self.client, self.step, self.device, self.model = client, step, device, model
        self.remote_dense, self.pulled = remote_dense, pulled

    def gather(self, ids: torch.Tensor) -> Gathered:
        uniq, inv, rows, dense_flat = gather_rows(
            self.client, ids, self.step, self.device, self.remote_dense, self.pulled
        )
        if self.remote_dense and dense_flat is not None:
            unflatten_into(dense_flat, self.model.dense_parameters())
        w, e = rows[:, 0][inv], F.embedding(inv, rows[:, 1:].contiguous())  # [B, F], [B, F, dim]
        return Gathered(w, e, uniq, inv.reshape(-1), None, rows)

    def row_grads(self, g: Gathered, gw: torch.Tensor, ge: torch.Tensor):
        return g.rows, row_sums(gw, ge, g.pos, g.rows.numel(), g.pulled.dtype)

    def current(self, g: Gathered, rows: torch.Tensor) -> torch.Tensor:
        return g.pulled  # the rows as pulled: the servers' weights this step read

    def fuses_l2(self, rule) -> bool:
        return False

    def update(self, g: Gathered, rows, grad, rule, l2=0.0, lr=None, dense_grads=None) -> None:
        dense = None
        if self.remote_dense:  # a zero gradient for a parameter the forward did not reach (None)
            params = self.model.dense_parameters()
            dense = flatten(
                [torch.zeros_like(p) if d is None else d for p, d in zip(params, dense_grads)]
            ).cpu()
        self.client.push({TABLE: (rows, grad)}, dense, self.step)


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
    """One pull -> forward/backward -> push (`sparse_step`, whose docstring says what ``clip_grad``,
    ``l2_emb`` and ``weight_decay`` add). Returns the mean log-loss (float tensor). ``pulled``: this batch's
    pull, sent ahead (`send_pull`). ``dense_opt`` (if any) is stepped with the dense gradients;
    ``remote_dense``: they travel with the push instead and the servers' dense parameters are pulled first.
    The servers (or an in-process shard) apply the rows' gradients with their rule."""
    store = RemoteRows(client, step, device, model, remote_dense, pulled)
    vals = None if bool((batch.vals == 1).all()) else batch.vals  # one-hot data: skip the products
    loss, grads = sparse_step(
        model, store, batch.ids, vals, batch.dense, batch.labels, None,
        autocast=autocast, clip_grad=clip_grad, l2_emb=l2_emb, weight_decay=weight_decay,
    )  # fmt: skip
    step_dense(model, grads, dense_opt)
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


def counter_path(run: RunDir, worker: int) -> Path:
    """``RUN/counters/worker-W.jsonl``: worker W's counters records, one JSON object a line."""
    return run.path / "counters" / f"worker-{worker}.jsonl"


def write_counter(run: RunDir, worker: int, rec: dict) -> None:
    """Append one record to `counter_path` (the job service and the web UI read them)."""
    path = counter_path(run, worker)
    path.parent.mkdir(exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
