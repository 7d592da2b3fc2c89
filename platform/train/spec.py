"""What an app's training is built from (`TrainSpec`, after torchtitan's train spec) and the one function
that builds the platform `Trainer` from it (`build_trainer`; `train_job` runs it as a data-parallel job).

A spec's fields after ``app`` and ``monitor`` are builders, called in field order; each one's result is
the piece of its name. A builder's parameters name what it takes: a config section by its ``NAME`` (given
as its typed dataclass: ``run``, ``input``, ``optim``, ...) or a piece: ``ctx`` (`DistContext`),
``rundir``, ``log``, ``app``, ``config`` (the resolved values as a dict, what an export records), ``cfg``
(the whole config, for the platform's step, whose optimizer reads several sections) or one built before
it (``data``, ``module``, ``model``, ...). Pieces given to `build_trainer`
are not built (pCTR gives its step, validation and exporter)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mariana.platform.core.evaluator import evaluator_from
from mariana.platform.core.export import export_model, warm_start
from mariana.platform.core.loop import Trainer
from mariana.platform.core.rundir import start_run
from mariana.platform.core.steps import ModuleStep, unwrap
from mariana.platform.dp.ddp import apply_data_parallel
from mariana.platform.runtime.dist import init_distributed, teardown

Builder = Callable[..., Any]


def nothing() -> None:
    """The builder of a piece the app does not have."""


def data_parallel(module, run, dp, ctx, app) -> Any:
    """``module`` warm-started (``--init-from``, weights of an ``app`` model), on ``ctx.device``, in DDP
    when the job has several processes."""
    if run.init_from:
        warm_start(module, run.init_from, app)
    return apply_data_parallel(module, ctx, grad_comm=dp.grad_comm)


def weights_exporter(config, ctx, rundir, app, model, export) -> Callable[[dict, int], None]:
    """-> ``exporter(metrics, step)``: rank 0 writes the model's weights (`export_model`) with the whole
    ``config`` and ``export``'s keys (``arch``, ``extra``: more of model.json)."""

    def write(metrics: dict, step: int) -> None:
        if ctx.is_main:
            state = unwrap(model).state_dict()
            export_model(rundir.path, state, app=app, config=config, metrics=metrics, **export)

    return write


@dataclass(frozen=True)
class TrainSpec:
    """One app's training: its ``app`` name, ``monitor`` (the default ``--monitor``) and its builders."""

    app: str
    monitor: str
    data: Builder = nothing  # -> the app's data (what its other builders take as ``data``)
    module: Builder = nothing  # -> the network (torch.nn.Module), built on the CPU
    model: Builder = nothing  # -> the module as the parallel strategy runs it (e.g. `data_parallel`)
    loader: Builder = nothing  # -> this rank's `BatchLoader` of training batches
    loss_fn: Builder = nothing  # -> loss_fn(model, batch) -> (loss [], samples), for the default step
    step: Builder = ModuleStep  # -> the strategy's `TrainStep` (default: one process and DDP)
    evaluate: Builder = nothing  # -> fn(model) -> {metric: value}; None: nothing to evaluate on
    export: Builder = nothing  # -> `weights_exporter`'s keys: {"arch": ..., "extra": {...}}
    exporter: Builder = weights_exporter  # -> exporter(metrics, step), called on every rank
    finish: Builder = nothing  # run after `Trainer.fit`; takes ``trainer`` and ``final`` too


def call(builder: Builder, pieces: dict[str, Any]) -> Any:
    """``builder`` called with the pieces (and sections) its parameters name (its defaults otherwise)."""
    params = inspect.signature(builder).parameters.values()
    return builder(**{p.name: pieces[p.name] for p in params if p.name in pieces or p.default is p.empty})


def build_trainer(spec: TrainSpec, cfg: Any, ctx, rundir, pieces: dict[str, Any], **kw: Any) -> Trainer:
    """The `Trainer` of ``spec`` on this process; the pieces not in ``pieces`` are built into it.
    ``kw``: the Trainer's own (``total``, ``checkpointer``, ``desc``)."""
    pieces.update({s.NAME: cfg.section(s.NAME) for s in type(cfg).SECTIONS})  # each section once
    pieces.update(cfg=cfg, config=dataclasses.asdict(cfg), ctx=ctx, rundir=rundir, app=spec.app)
    for name in [f.name for f in dataclasses.fields(spec)][2:-1]:  # data ... exporter
        if name not in pieces:
            pieces[name] = call(getattr(spec, name), pieces)
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
        call(spec.finish, {**pieces, "trainer": trainer, "final": final})
        return final
    finally:
        teardown(ctx)
