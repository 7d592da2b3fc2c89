"""The pCTR training step, in one process and as a parameter-server worker (the Trainer's step objects).

Both run the same math: the unique rows of a batch are pulled (from a local shard or from the servers),
the model runs on them (`CTRModel.forward_parts`), and the gradient of exactly those rows is pushed back and
applied by the row optimiser; dense parameters use a torch optimiser (locally, or on server 0).

`LocalStep`: the table lives in this process (CPU or CUDA), checkpoints hold everything the next step
depends on. `PSWorkerStep`: rows and dense parameters live on the servers; checkpoints are the servers'
(`ServerCheckpointer`), a restarted worker resumes at the step the servers say.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.optim import build_scheduler, lr_factor
from mariana.platform.core.rundir import RunDir
from mariana.platform.core.steps import autocast_for
from mariana.platform.ps.sparse_step import FixedShapeStep, clip_
from mariana.platform.ps.worker import LocalClient

from .configs import PctrConfig
from .data import Batch
from .model import CTRModel, build_model
from .optim import build_dense, row_config

TABLE = "table"


class Pulled(NamedTuple):
    """A batch whose rows' pull is in flight: ``uniq`` [U] its unique ids, ``inv`` [B, F] their inverse,
    ``pending.wait()`` -> (table -> rows [U, K], dense flat [P] or None)."""

    batch: Batch
    uniq: torch.Tensor
    inv: torch.Tensor
    pending: Any


def send_pull(client, batch: Batch, step: int, want_dense: bool = False) -> Pulled:
    """Start pulling the unique rows of ``batch.ids [B, F]`` (and the dense parameters) for ``step``."""
    uniq, inv = torch.unique(batch.ids, return_inverse=True)
    return Pulled(batch, uniq, inv, client.pull_async({TABLE: uniq}, step, want_dense))


def fresh_rows(cfg: PctrConfig, n: int, width: int, step: int, worker: int = 0) -> torch.Tensor:
    """Weights [n, width] for ``n`` rows that `--ids dynamic` evicted at ``step``: N(0, init_std), linear
    weight (column 0) 0, as a new table's rows. Seeded by (seed, step), and the worker on parameter-server
    workers other than 0, so that a resumed run, and worker 0 of a one-worker job, redraw exactly what one
    process draws."""
    seed = cfg.seed * 7919 + 104729 + step + (worker * 1_000_003 if worker else 0)
    fresh = torch.randn(n, width, generator=torch.Generator().manual_seed(seed)) * cfg.init_std
    fresh[:, 0] = 0.0
    return fresh


class RemoteIdMap:
    """Read-only `--ids dynamic` map on parameter server 0 (``lookup(keys [n, F]) -> rows [n, F]``, numpy),
    for a worker's validation."""

    def __init__(self, client):
        self.client = client

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        return self.client.lookup(torch.from_numpy(np.ascontiguousarray(keys, np.int64))).numpy()


class _PendingMap(NamedTuple):
    """A batch pulled ahead under `--ids dynamic`: its keys are being mapped on server 0, and the answer's
    callback sends the pull; ``future.wait()`` -> its `Pulled`."""

    batch: Batch
    future: Any


class _Done:
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


def build_dense_only(cfg: PctrConfig, schema) -> CTRModel:
    """The model with a 1-row-per-field table stub, for processes whose rows live on parameter servers.
    Its dense layers start as in-process training's: they are created before the table (see CTRModel)."""
    return build_model(cfg, type(schema)(schema.format, schema.num_fields, 1, schema.num_dense))


def train_step(
    model: CTRModel,
    client,
    batch: Batch,
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
    gradients are summed per unique row with one ``index_add_`` into ``[U, 1 + dim]`` (cheaper on CPU than
    the embedding backward over a ``[U, K]`` leaf). ``autocast`` (a context factory) wraps the forward."""
    if isinstance(client, LocalClient) and not remote_dense and pulled is None:  # the fixed-shape step
        loss, _ = local_step(model, client.shard, batch, dense_opt, autocast, clip_grad, l2_emb, weight_decay)
        return loss
    uniq, inv, rows, dense_flat = gather_rows(client, batch.ids, step, device, remote_dense, pulled)
    if remote_dense and dense_flat is not None:
        from mariana.platform.ps.dense import unflatten_into

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
        return rows.new_zeros(U, width).index_add_(0, flat_inv, g.reshape(flat_inv.numel(), width))

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
        from mariana.platform.ps.dense import flatten

        dense_grad = flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in params]).cpu()
    client.push({TABLE: (uniq, row_grad)}, dense_grad, step)
    if dense_opt is not None:
        dense_opt.step()
    return loss.detach()


def local_step(
    model,
    shard,
    batch: Batch,
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


def apply_dense(fixed: FixedShapeStep, batch: Batch, row_opt, dense_opt) -> torch.Tensor:
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
    model: CTRModel, batches, client, device, seen=None, rows_per_field=None, idmap=None
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


class LocalStep:
    """`TrainStep` of one-process training: the model's ``table.weight`` is the local shard's table.

    ``evaluate(fn)`` calls ``fn(self)`` (``self.model``, ``self.client``, ``self.device`` score the
    validation rows); the dense learning rate follows ``--schedule``/``--warmup-steps`` and the table's
    learning rate the same factor."""

    data_parallel = 1

    def __init__(self, cfg: PctrConfig, setup, device: torch.device):
        from mariana.platform.ps.shard import EmbeddingShard, init_rows
        from mariana.platform.ps.worker import LocalClient

        self.cfg, self.device = cfg, device
        self.model = build_model(cfg, setup.schema, table=init_rows(setup.spec, cfg.seed)).to(device)
        self.rows_opt = row_config(cfg)
        self.shard = EmbeddingShard(
            [setup.spec], 0, 1, self.rows_opt, cfg.seed, device, {TABLE: self.model.table.weight.data}
        )
        self.client = LocalClient(self.shard)
        self.dense_opt = build_dense(cfg, self.model.dense_parameters())
        self.amp = functools.partial(autocast_for, cfg, device)
        self.t, self.total, self.sched = 0, 1, None
        self.idmap = None  # `--ids dynamic`: keys -> rows, batch by batch in training order (idmap.py)
        if getattr(cfg, "ids", "hash") == "dynamic":
            from .idmap import IdMap

            s = setup.schema
            self.idmap = IdMap(s.num_fields, s.rows_per_field, cfg.admit_after, cfg.evict, cfg.sketch_width)
            setup.idmap = self.idmap  # exported with the table
        self._lrs = {"lr": cfg.lr, "sparse_lr": cfg.sparse_lr}
        # criteo's values are all 1 by construction (decided once per data set, not per batch)
        unit = setup.schema.format == "criteo" and getattr(setup, "image", None) is None
        self.fixed = FixedShapeStep(
            self.model,
            self.shard.weight[TABLE],
            self.shard.state[TABLE],
            self.shard.seen[TABLE],
            unit_vals=unit,
            autocast=self.amp,
            clip_grad=cfg.clip_grad,
            l2_emb=cfg.l2_emb_value(),
            weight_decay=cfg.weight_decay,
        )

    def setup(self, total_steps: int) -> None:
        self.total = total_steps
        self.sched = build_scheduler(self.cfg, self.dense_opt, total_steps)

    def train_step(self, micro_batches: list[Batch]) -> tuple[torch.Tensor, int]:
        cfg = self.cfg
        factor = lr_factor(self.t, self.total, cfg.warmup_steps, cfg.schedule)
        self.shard.opt = replace(self.rows_opt, lr=cfg.sparse_lr * factor)
        self._lrs = {"lr": self.dense_opt.param_groups[0]["lr"], "sparse_lr": self.shard.opt.lr}
        loss, n = torch.zeros((), device=self.device), 0
        for batch in micro_batches:
            batch = batch.to(self.device)
            if self.idmap is not None:
                batch = self.map_ids(batch)
            loss = loss + apply_dense(self.fixed, batch, self.shard.opt, self.dense_opt)
            n += len(batch)
        self.sched.step()
        self.t += 1
        return loss, n

    def mean_loss(self, loss_sum: torch.Tensor, steps: int) -> float:
        return float(loss_sum) / max(1, steps)

    def map_ids(self, batch: Batch) -> Batch:
        """`--ids dynamic`: the batch's keys [B, F] -> rows through the id map (counting, admitting,
        evicting). An evicted row starts over as a fresh row of a new table: weights redrawn from
        N(0, init_std) (linear weight 0, as `init_rows`), row-optimiser state reset, ``seen`` cleared, so the
        id that takes it inherits nothing of the id that held it. The redraw is seeded by (seed, step):
        a resumed run redraws the same values."""
        from mariana.platform.ps.rowopt import init_state

        rows, evicted = self.idmap.assign(batch.ids.cpu().numpy())
        if len(evicted):
            w = self.model.table.weight.data
            idx = torch.from_numpy(evicted).to(w.device)
            fresh = fresh_rows(self.cfg, len(evicted), w.shape[1], self.t)  # as PSWorkerStep's (fresh_rows)
            w.index_copy_(0, idx, fresh.to(w.device, w.dtype))
            for k, v in init_state(self.rows_opt.rule, fresh.to(w.device, w.dtype), self.rows_opt).items():
                self.shard.state[TABLE][k].index_copy_(0, idx, v)
            self.shard.seen[TABLE][idx] = False
        return replace(batch, ids=torch.from_numpy(rows).to(batch.ids.device))

    def evaluate(self, fn) -> dict[str, float]:
        return fn(self)

    def checkpoint_state(self, folder: Path) -> dict[str, Any]:
        """The model (its ``table.weight`` is the table itself), the dense optimiser and schedule, the
        table's row-optimiser state and ``seen`` flags, the step counter of the table's schedule."""
        return {
            "model": self.model.state_dict(),
            "dense_opt": self.dense_opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "rows": {
                "state": dict(self.shard.state[TABLE]),
                "seen": self.shard.seen[TABLE],
                **({"idmap": self.idmap.state_dict()} if self.idmap is not None else {}),
            },
            "t": self.t,
        }

    def restore(self, state: dict[str, Any], folder: Path) -> None:
        """Copy a checkpoint into the live objects (in place: the shard and the model share the table).
        MarianaError naming the checkpoint if it does not fit this model."""
        try:
            self.model.load_state_dict(state["model"])
            self.dense_opt.load_state_dict(state["dense_opt"])
            self.sched.load_state_dict(state["scheduler"])
            self.load_row_state(state["rows"])
            self.t = int(state["t"])
        except (KeyError, RuntimeError, ValueError) as e:
            raise MarianaError(
                f"checkpoint in {folder} does not fit this model: {str(e).splitlines()[0]}"
            ) from None

    def load_row_state(self, rows: dict[str, Any]) -> None:
        live = self.shard.state[TABLE]
        if sorted(live) != sorted(rows["state"]):
            raise ValueError(f"row optimiser state {sorted(rows['state'])}, expected {sorted(live)}")
        if ("idmap" in rows) != (self.idmap is not None):
            raise ValueError(f"id map {'present' if 'idmap' in rows else 'absent'}: the run's --ids differs")
        for k, v in rows["state"].items():
            live[k].copy_(v)
        self.shard.seen[TABLE].copy_(rows["seen"])
        if self.idmap is not None:
            self.idmap.load_state_dict(rows["idmap"])

    def lrs(self) -> dict[str, float]:
        """The learning rates, and with ``--ids dynamic`` the id map's totals (every metrics.jsonl record)."""
        if self.idmap is None:
            return dict(self._lrs)
        c = self.idmap.counters()
        return {**self._lrs, **{k: v for k, v in c.items() if not isinstance(v, list)}}

    def comm_stats(self) -> tuple[float, int]:
        return 0.0, 0

    def table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(table [rows, 1 + dim], seen [rows] bool) for export."""
        return self.model.table.weight.data, self.shard.seen[TABLE]


class PSWorkerStep:
    """`TrainStep` of a parameter-server worker: pull rows (and, from server 0, the dense parameters),
    compute, push the rows' and the dense gradients; the servers apply them. ``evaluate(fn)`` first waits
    for this worker's pushes and pulls the current dense parameters."""

    data_parallel = 1

    def __init__(self, cfg: PctrConfig, schema, client, role, run: RunDir):
        self.cfg, self.client, self.role, self.run = cfg, client, role, run
        self.device = torch.device("cpu")
        torch.manual_seed(cfg.seed)
        self.model = build_dense_only(cfg, schema)  # rows come from the servers
        self.amp = functools.partial(autocast_for, cfg, self.device)
        self.t, self.n, self.loss_sum, self.loss_n = 0, 0, 0.0, 0
        self.pulled_ahead = 0  # steps whose rows were pulled by `PullAheadLoader` (for the counters)
        self.t0 = time.perf_counter()
        # `--ids dynamic`: server 0 maps each batch's keys to rows (`ParamServer.assign`) before its pull;
        # the rows it evicted are redrawn here (`fresh_rows`) and reset by their servers within that pull
        self.dynamic = getattr(cfg, "ids", "hash") == "dynamic"
        self.width = 1 + (0 if cfg.model == "lr" else cfg.dim)  # the table's row width (Setup.spec)
        self.ids_evicted = 0  # rows evicted for this worker's batches
        self.assign_s = 0.0  # seconds waited for server 0's answers (keys -> rows)
        self._mapping = None  # the answer of the last batch sent ahead to server 0's map

    def setup(self, total_steps: int) -> None:
        pass

    @property
    def pulls_ahead(self) -> bool:
        return self.cfg.pull_ahead and self.client.can_pull_ahead

    def send_pull(self, batch: Batch, step: int, ahead: bool = True) -> Pulled | _PendingMap:
        """Start the pull of ``batch`` for ``step``. With `--ids dynamic` its keys are first mapped to rows
        on server 0 and the evicted rows' fresh weights travel with the pull: ahead (`PullAheadLoader`),
        the keys are sent at once and the pull when the answer arrives (a `_PendingMap`), after the
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
        return _PendingMap(batch, self._mapping.then(lambda f: self._pull_mapped(batch, step, *f.wait())))

    def wait_mapped(self) -> None:
        """Wait for server 0's answer to the batch sent ahead (`--ids dynamic`), so that a checkpoint
        taken now always holds it (the replay after a restart then takes the saved answer)."""
        if self._mapping is not None:
            self._mapping.wait()

    def _pull_mapped(self, batch: Batch, step: int, rows, evicted, ahead: bool = True) -> Pulled:
        """The pull of ``batch`` whose keys server 0 mapped to ``rows`` [B, F], evicting ``evicted`` [E]."""
        self.ids_evicted += len(evicted)
        resets = None
        if len(evicted):
            resets = {TABLE: (evicted, fresh_rows(self.cfg, len(evicted), self.width, step, self.role.index))}
        batch = replace(batch, ids=rows)
        uniq, inv = torch.unique(rows, return_inverse=True)
        if ahead:
            return Pulled(batch, uniq, inv, self.client.pull_async({TABLE: uniq}, step, True, resets))
        return Pulled(batch, uniq, inv, _Done(self.client.pull({TABLE: uniq}, step, True, resets)))

    def train_step(self, micro_batches: list[Batch | Pulled]) -> tuple[torch.Tensor, int]:
        (item,) = micro_batches
        self.pulled_ahead += isinstance(item, (Pulled, _PendingMap))
        if isinstance(item, _PendingMap):  # `--ids dynamic` ahead: the pull goes out with the map's answer
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
        from mariana.platform.ps.dense import unflatten_into

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
