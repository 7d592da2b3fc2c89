"""What an app's training is built from (`TrainSpec`, after torchtitan's train spec) and the one function
that builds the platform `Trainer` from it (`build_trainer`; `train_job` runs it as a data-parallel job).

A spec's fields after ``app`` and ``monitor`` are builders, called in field order; each one's result is
the piece of its name. A builder's parameters name what it takes: a config section by its ``NAME`` (given
as its typed dataclass: ``run``, ``input``, ``optim``, ...) or a piece: ``ctx`` (`DistContext`),
``rundir``, ``log``, ``app``, ``cfg`` (the whole config, for what reads several sections, e.g. the
step's optimizer) or one built before it (``data``, ``model``, ...). Pieces given to `build_trainer`
are not built (pCTR gives its step, validation and exporter)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mariana.platform.core.evaluator import evaluator_from
from mariana.platform.core.export import export_model
from mariana.platform.core.loop import Trainer
from mariana.platform.core.rundir import start_run
from mariana.platform.core.steps import ModuleStep, unwrap
from mariana.platform.core.warmstart import warm_start
from mariana.platform.dp.ddp import apply_data_parallel
from mariana.platform.runtime.dist import init_distributed, teardown

Builder = Callable[..., Any]


def nothing() -> None:
    """The builder of a piece the app does not have."""


def data_parallel(model, run, dp, ctx, app) -> Any:
    """``model`` warm-started (``--init-from``, weights of an ``app`` model), on ``ctx.device``, in DDP
    when the job has several processes."""
    if run.init_from:
        warm_start(model, run.init_from, app)
    return apply_data_parallel(model, ctx, grad_comm=dp.grad_comm)


def weights_exporter(cfg, ctx, rundir, app, parallel, export) -> Callable[[dict, int], None]:
    """-> ``exporter(metrics, step)``: rank 0 writes the module's weights (`export_model`) with the whole
    config and ``export``'s keys (``arch``, ``extra``: more of model.json)."""

    def write(metrics: dict, step: int) -> None:
        if ctx.is_main:
            state, config = unwrap(parallel).state_dict(), dataclasses.asdict(cfg)
            export_model(rundir.path, state, app=app, config=config, metrics=metrics, **export)

    return write


@dataclass(frozen=True)
class TrainSpec:
    """One app's training: its ``app`` name, ``monitor`` (the default ``--monitor``) and its builders."""

    app: str
    monitor: str
    data: Builder = nothing  # -> the app's data (what its other builders take as ``data``)
    model: Builder = nothing  # -> the network (torch.nn.Module), built on the CPU
    parallel: Builder = nothing  # -> the model as the parallel strategy runs it (e.g. `data_parallel`)
    loader: Builder = nothing  # -> this rank's `BatchLoader` of training batches
    loss: Builder = nothing  # -> loss(model, batch) -> (loss [], samples), for the default step
    step: Builder = lambda cfg, parallel, loss, ctx: ModuleStep(cfg, parallel, loss, ctx)  # the DP step
    evaluate: Builder = nothing  # -> fn(model) -> {metric: value}; None: nothing to evaluate on
    export: Builder = nothing  # -> `weights_exporter`'s keys: {"arch": ..., "extra": {...}}
    exporter: Builder = weights_exporter  # -> exporter(metrics, step), called on every rank
    finish: Builder = nothing  # run after `Trainer.fit`; takes ``trainer`` and ``final`` too

    def call(self, builder: Builder, cfg: Any, pieces: dict[str, Any]) -> Any:
        names = {s.NAME for s in type(cfg).SECTIONS}
        params = inspect.signature(builder).parameters
        return builder(**{p: cfg.section(p) if p in names else pieces[p] for p in params})


def build_trainer(spec: TrainSpec, cfg: Any, ctx, rundir, pieces: dict[str, Any], **kw: Any) -> Trainer:
    """The `Trainer` of ``spec`` on this process; the pieces not in ``pieces`` are built into it.
    ``kw``: the Trainer's own (``total``, ``checkpointer``, ``desc``)."""
    pieces.update(cfg=cfg, ctx=ctx, rundir=rundir, app=spec.app)
    for name in [f.name for f in dataclasses.fields(spec)][2:-1]:  # data ... exporter
        if name not in pieces:
            pieces[name] = spec.call(getattr(spec, name), cfg, pieces)
    evaluator = evaluator_from(cfg, pieces["evaluate"], spec.monitor)
    return Trainer(cfg, pieces["step"], pieces["loader"], ctx, rundir, evaluator, pieces["exporter"], **kw)


def train_job(spec: TrainSpec, cfg: Any) -> dict[str, Any]:
    """Train ``spec`` in this process (a rank under torchrun) -> the final metrics."""
    ctx = init_distributed(cfg.device, cfg.timeout)
    try:
        rundir, log = start_run(cfg, ctx.rank, ctx.is_main)
        pieces: dict[str, Any] = {"log": log}
        trainer = build_trainer(spec, cfg, ctx, rundir, pieces)
        final = trainer.fit()
        spec.call(spec.finish, cfg, {**pieces, "trainer": trainer, "final": final})
        return final
    finally:
        teardown(ctx)
