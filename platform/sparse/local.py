"""`LocalStep`: the `TrainStep` of one-process sparse training (pCTR's ``--servers 0``).

The table lives in this process (CPU or CUDA): the model's table weight itself, with the rule's state and
``seen`` flags, in a local row store (`store.local_store`); each batch runs `SparseStep` (one gather, the
rows' gradient summed per row, the row update in place), compiled (and on CUDA replayed as a CUDA graph)
where `compile_mode` says so; dense parameters use the given torch optimiser. Checkpoints hold everything
the next step depends on. The application builds the model and the optimisers (the shapes of
`mariana.platform.ps.protocol`, which this package does not import: the framework imports it).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.errors import MarianaError
from ..core.optim import build_scheduler, lr_factor
from ..core.steps import autocast_for
from .rules import RowOptConfig, init_state
from .step import SparseStep, apply_dense


def fresh_rows(seed: int, init_std: float, n: int, width: int, step: int, worker: int = 0) -> torch.Tensor:
    """Weights [n, width] for ``n`` rows that `--ids dynamic` evicted at ``step``: N(0, init_std), linear
    weight (column 0) 0, as a new table's rows. Seeded by (seed, step), and the worker on parameter-server
    workers other than 0, so that a resumed run, and worker 0 of a one-worker job, redraw exactly what one
    process draws."""
    seed = seed * 7919 + 104729 + step + (worker * 1_000_003 if worker else 0)
    fresh = torch.randn(n, width, generator=torch.Generator().manual_seed(seed)) * init_std
    fresh[:, 0] = 0.0
    return fresh


def compile_mode(cfg, device: torch.device) -> tuple[str, str | None] | None:
    """How the one-process step runs on ``device``: None (eager) or ``(backend, mode)`` for
    `SparseStep.compile`. ``cfg.compile`` "on" / "off", or "auto": compiled on CUDA (the step is
    launch-bound there: one fused graph) and eager on the CPU (where the eager step's unique-row update
    touches fewer rows). Inductor on CUDA captures the step in a CUDA graph (``reduce-overhead``)."""
    on = cfg.compile == "on" or (cfg.compile == "auto" and device.type == "cuda")
    if not on:
        return None
    graphs = device.type == "cuda" and cfg.compile_backend == "inductor"
    return cfg.compile_backend, "reduce-overhead" if graphs else None


class LocalStep:
    """`TrainStep` of one-process training: the model's table is the store's table (one tensor).

    ``evaluate(fn)`` calls ``fn(self)`` (``self.model``, ``self.client``, ``self.device`` score the
    validation rows); the dense learning rate follows ``--schedule``/``--warmup-steps`` and the table's
    learning rate the same factor."""

    data_parallel = 1

    def __init__(
        self,
        cfg,
        model: nn.Module,
        table: torch.Tensor,
        rows_opt: RowOptConfig,
        dense_opt: torch.optim.Optimizer,
        device: torch.device,
        unit_vals: bool = False,
        idmap=None,
    ):
        """``cfg``: a `StepConfig`; ``model`` (a `SparseModel`) on ``device``, whose table adopted ``table``
        [rows, 1 + dim] (trained in place); ``rows_opt``: the row optimiser; ``dense_opt``: over the model's
        dense parameters; ``unit_vals``: every value of the data set is 1 (decided once per data set);
        ``idmap``: keys -> rows (a `KeyMap`), batch by batch in training order (pCTR's ``--ids dynamic``)."""
        self.cfg, self.device, self.model = cfg, device, model
        self.rows_opt = self.opt = rows_opt
        self.dense_opt = dense_opt
        self.amp = functools.partial(autocast_for, cfg, device)
        self.t, self.total, self.sched = 0, 1, None
        self.idmap = idmap
        self._lrs = {"lr": cfg.lr, "sparse_lr": cfg.sparse_lr}
        seen = torch.zeros(table.shape[0], dtype=torch.bool, device=table.device)
        self.fixed = SparseStep(
            self.model,
            table,
            init_state(rows_opt.rule, table, rows_opt),
            seen,
            unit_vals=unit_vals,
            autocast=self.amp,
            clip_grad=cfg.clip_grad,
            l2_emb=cfg.l2_emb_value(),
            weight_decay=cfg.weight_decay,
        )
        self.store = self.client = self.fixed.store  # the table, its state and seen; `pull` for validation
        self.compiled = compile_mode(cfg, device)  # (backend, mode), or None: eager
        if self.compiled is not None:
            self.fixed.compile(*self.compiled)

    def setup(self, total_steps: int) -> None:
        self.total = total_steps
        self.sched = build_scheduler(self.cfg, self.dense_opt, total_steps)

    def train_step(self, micro_batches: list) -> tuple[torch.Tensor, int]:
        cfg = self.cfg
        factor = lr_factor(self.t, self.total, cfg.warmup_steps, cfg.schedule)
        self.opt = replace(self.rows_opt, lr=cfg.sparse_lr * factor)
        self._lrs = {"lr": self.dense_opt.param_groups[0]["lr"], "sparse_lr": self.opt.lr}
        loss, n = torch.zeros((), device=self.device), 0
        for batch in micro_batches:
            batch = batch.to(self.device)
            if self.idmap is not None:
                batch = self.map_ids(batch)
            loss = loss + apply_dense(self.fixed, batch, self.opt, self.dense_opt)
            n += len(batch)
        self.sched.step()
        self.t += 1
        return loss, n

    def mean_loss(self, loss_sum: torch.Tensor, steps: int) -> float:
        return float(loss_sum) / max(1, steps)

    def map_ids(self, batch):
        """`--ids dynamic`: the batch's keys [B, F] -> rows through the id map (counting, admitting,
        evicting). An evicted row starts over as a fresh row of a new table: weights redrawn from
        N(0, init_std) (linear weight 0, as `init_rows`), row-optimiser state reset, ``seen`` cleared, so the
        id that takes it inherits nothing of the id that held it. The redraw is seeded by (seed, step):
        a resumed run redraws the same values."""
        rows, evicted = self.idmap.assign(batch.ids.cpu().numpy())
        if len(evicted):
            w = self.store.weight  # the same redraw as PSWorkerStep's (fresh_rows), the servers' reset
            fresh = fresh_rows(self.cfg.seed, self.cfg.init_std, len(evicted), w.shape[1], self.t)
            self.store.reset(torch.from_numpy(evicted).to(w.device), fresh, self.rows_opt)
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
                "state": dict(self.store.state),
                "seen": self.store.seen,
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
        live = self.store.state
        if sorted(live) != sorted(rows["state"]):
            raise ValueError(f"row optimiser state {sorted(rows['state'])}, expected {sorted(live)}")
        if ("idmap" in rows) != (self.idmap is not None):
            raise ValueError(f"id map {'present' if 'idmap' in rows else 'absent'}: the run's --ids differs")
        for k, v in rows["state"].items():
            live[k].copy_(v)
        self.store.seen.copy_(rows["seen"])
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
        return self.store.weight, self.store.seen
