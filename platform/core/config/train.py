"""The platform's sections of a training command and `TrainConfig`, the composition of all of them (the
data-parallel trainer's config; apps compose the sections they use, overriding defaults by subclassing a
section). Standard library only."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import ClassVar

from ..endpoint import check_endpoint
from ..errors import MarianaError
from ..evaluator import higher_is_better, metric_name
from .fields import VALIDATES, flag, given, only, opt, when
from .files import read_config_values
from .sections import Config, Section

# Fields a --resume may give other values than the checkpoint's RUN/config.toml (they change neither the
# model, nor the data order, nor optimizer state that the checkpoint restores).
RESUME_MAY_CHANGE = frozenset(
    {
        "out", "config", "preset", "resume", "force",  # where the run is and how the values were given
        "epochs", "max_steps",  # how long to train (the LR schedule follows the new length)
        "log_every", "eval_every", "ckpt_every", "progress",  # reporting
        "early_stop", "init_from",  # when to stop; the warm start only matters before the first step
        "timeout", "max_restarts", "rdzv_endpoint", "rdzv_id",  # fault handling and rendezvous
        "device", "amp", "grad_comm", "num_workers",  # where and how fast, not what
    }
)  # fmt: skip


def at_least_one(cfg, names: tuple[str, ...]) -> None:
    """MarianaError ``--x must be >= 1`` for the first of ``names`` below 1."""
    for name in names:
        if getattr(cfg, name) < 1:
            raise MarianaError(f"--{flag(name)} must be >= 1, got {getattr(cfg, name)}")


def non_negative(cfg, names: tuple[str, ...]) -> None:
    """MarianaError ``--x must be >= 0`` for the first of ``names`` below 0."""
    for name in names:
        if getattr(cfg, name) < 0:
            raise MarianaError(f"--{flag(name)} must be >= 0, got {getattr(cfg, name)}")


def finite_non_negative(cfg, names: tuple[str, ...]) -> None:
    """MarianaError for the first of ``names`` that is not a finite number >= 0."""
    for name in names:
        value = getattr(cfg, name)
        if not (math.isfinite(value) and value >= 0):
            raise MarianaError(f"--{flag(name)} must be a finite number >= 0, got {value}")


def own_preset(cfg) -> bool:
    """Whether ``--preset`` counts: always on a new run; on ``--resume`` the run's values (RUN/config.toml)
    replace the preset's, so only the run's own preset (the first command repeated) is not ignored."""
    saved = os.path.join(cfg.out, "config.toml")
    return (
        not cfg.resume or os.path.isfile(saved) and read_config_values(saved).get("preset", "") == cfg.preset
    )


@dataclass
class RunSection(Section):
    """Where the run is, how its values are given, and what it starts from."""

    NAME: ClassVar[str] = "run"
    TITLE: ClassVar[str] = "run directory, config sources, device"

    out: str = opt(
        "runs/run", "run directory to create (config.toml, checkpoints/, metrics.jsonl, ...)", path=True
    )
    config: str = opt(
        "",
        "TOML file with config values, one [section] table per flag group below (flags given on the command "
        "line override it)",
        path=True,
    )
    preset: str = opt(
        "",
        "named preset of defaults (e.g. debug, small); see the app's configs.py",
        applies=when("resume", own_preset, "new runs, or a --resume of a run made with it", False, True),
    )
    resume: bool = opt(False, "continue from the last checkpoint in --out")
    force: bool = opt(
        False,
        "train into an --out that holds data this command did not create, or over a finished run (its "
        "checkpoints, model and metrics are removed first)",
    )
    init_from: str = opt(
        "",
        "warm start: initial weights from a run directory or model.safetensors (not --resume: a new run "
        "with fresh optimizer state and schedule)",
        path=True,
    )
    seed: int = opt(0, "random seed (model init, shuffling, augmentation)")
    device: str = opt("auto", "compute device: auto picks cuda when available", ["auto", "cpu", "cuda"])
    progress: bool = opt(True, "show a progress bar on rank 0")

    def validate(self) -> None:
        if self.init_from and not os.path.exists(self.init_from):
            raise MarianaError(f"--init-from {self.init_from}: no such run directory or model file")


@dataclass
class DataSection(Section):
    """The training data (apps subclass it to add their own data fields and describe the layout)."""

    NAME: ClassVar[str] = "input"
    TITLE: ClassVar[str] = "training data"

    data: str = opt("", "training data path (file or folder; see the app's docs for the layout)", path=True)


@dataclass
class LaunchSection(Section):
    """Processes, nodes, rendezvous and fault handling (the launcher's settings)."""

    NAME: ClassVar[str] = "launch"
    TITLE: ClassVar[str] = "processes, nodes and restarts"

    workers: int = opt(1, "data-parallel worker processes on this node (launched through torchrun)")
    nnodes: int = opt(1, "number of nodes (multi-node runs rendezvous at --rdzv-endpoint)")
    rdzv_endpoint: str = opt("", "host:port of the c10d rendezvous for multi-node runs")
    rdzv_id: str = opt(
        "mariana",
        "rendezvous id shared by all nodes of one job",
        applies=given("rdzv_endpoint", "127.0.0.1:29500"),
    )
    max_restarts: int = opt(0, "torchrun restarts of failed workers; they resume from the last checkpoint")
    timeout: float = opt(300.0, "collective timeout in seconds: a rank that stalls longer fails the job")

    def validate(self) -> None:
        at_least_one(self, ("workers", "nnodes"))
        non_negative(self, ("max_restarts",))
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise MarianaError(f"--timeout must be > 0 seconds, got {self.timeout}")
        if self.rdzv_endpoint:
            check_endpoint(self.rdzv_endpoint)
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise MarianaError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")


def several_workers(cfg) -> bool:
    """More than one data-parallel process in all (so there is a gradient all-reduce)."""
    return cfg.workers * cfg.nnodes > 1


@dataclass
class DataParallelSection(Section):
    """How a data-parallel step runs: precision, gradient exchange, accumulation, loader processes."""

    NAME: ClassVar[str] = "dp"
    TITLE: ClassVar[str] = "data-parallel step"

    amp: str = opt(
        "auto", "mixed precision: auto = bf16 autocast on GPU, off on CPU", ["auto", "bf16", "off"]
    )
    grad_comm: str = opt(
        "fp32",
        "gradient all-reduce precision (bf16/fp16 halve the bytes)",
        ["fp32", "bf16", "fp16"],
        applies=when("workers", several_workers, "more than one worker (--workers/--nnodes)", 2, 1),
    )
    grad_accum: int = opt(1, "micro-steps accumulated per optimizer step")
    num_workers: int = opt(0, "data-loader worker processes per training process")

    def validate(self) -> None:
        at_least_one(self, ("grad_accum",))
        non_negative(self, ("num_workers",))


# --epochs counts only when --max-steps does not set the length (apps overriding epochs' default reuse it)
WITHOUT_MAX_STEPS = when("max_steps", lambda cfg: not cfg.max_steps, "runs without --max-steps", 0, 1)


@dataclass
class LoopSection(Section):
    """How long to train, how often to report, evaluate and checkpoint, and when to stop early."""

    NAME: ClassVar[str] = "loop"
    TITLE: ClassVar[str] = "length, reporting, evaluation and checkpoints"

    epochs: int = opt(1, "passes over the training data", applies=WITHOUT_MAX_STEPS)
    max_steps: int = opt(0, "optimizer steps to run; 0 means --epochs full passes")
    log_every: int = opt(10, "optimizer steps between metrics.jsonl records")
    eval_every: int = opt(
        0,
        "evaluate every N optimizer steps, or 'epoch' at the end of every epoch; 0 only at the end",
        epoch_ok=True,
        applies=VALIDATES,
    )
    monitor: str = opt(
        "",
        "evaluation metric that picks the best model and drives --early-stop (e.g. auc, logloss, wer, top1; "
        "its direction is known); empty: the app's headline metric",
        applies=VALIDATES,
    )
    early_stop: int = opt(
        0,
        "stop after this many evaluations in a row without a better --monitor value; 0 never stops early",
        applies=VALIDATES,
    )
    ckpt_every: int = opt(0, "optimizer steps between checkpoints; 0 checkpoints only at the end")

    def validate(self) -> None:
        at_least_one(self, ("epochs", "log_every"))
        if self.eval_every < -1:
            raise MarianaError(
                f"--eval-every must be a number of steps >= 0 or 'epoch', got {self.eval_every}"
            )
        non_negative(self, ("max_steps", "ckpt_every", "early_stop"))
        if self.monitor:
            higher_is_better(self.monitor)  # an unknown metric name is refused before any worker starts


@dataclass
class OptimBase(Section):
    """Batch size, optimizer and learning-rate schedule (without SGD momentum: see `OptimSection`)."""

    NAME: ClassVar[str] = "optim"
    TITLE: ClassVar[str] = "batch, optimizer and learning-rate schedule"

    batch_size: int = opt(
        64, "samples per worker per micro-step (global batch = workers x this x grad-accum)"
    )
    optimizer: str = opt("adamw", "optimizer", ["sgd", "adam", "adamw"])
    lr: float = opt(1e-3, "peak learning rate")
    weight_decay: float = opt(0.0, "decoupled weight decay")
    schedule: str = opt("constant", "learning-rate schedule after warm-up", ["constant", "cosine", "linear"])
    warmup_steps: int = opt(0, "linear warm-up steps")
    clip_grad: float = opt(0.0, "clip the global gradient norm to this value; 0 disables")

    def validate(self) -> None:
        at_least_one(self, ("batch_size",))
        non_negative(self, ("warmup_steps",))
        finite_non_negative(self, ("lr", "weight_decay", "clip_grad"))


@dataclass
class OptimSection(OptimBase):
    """`OptimBase` plus SGD momentum (the platform's torch optimizers)."""

    momentum: float = opt(0.9, "SGD momentum", applies=only("optimizer", "sgd"))

    def validate(self) -> None:
        super().validate()
        finite_non_negative(self, ("momentum",))


class TrainJob(Config):
    """Base of the training compositions: `check` refuses a ``--monitor`` the evaluation does not report
    (``EVAL_METRICS``; empty: only the name's direction is checked, by `LoopSection`). A composition
    extends ``RESUME_MAY_CHANGE``: ``RESUME_MAY_CHANGE = RESUME_MAY_CHANGE | {"eval_data"}``."""

    RESUME_MAY_CHANGE: ClassVar[frozenset[str]] = RESUME_MAY_CHANGE

    def check(self) -> None:
        monitor, reported = getattr(self, "monitor", ""), type(self).EVAL_METRICS
        if monitor and reported and metric_name(monitor) not in reported:
            raise MarianaError(
                f"--monitor {monitor}: the evaluation reports no such metric (this job's "
                f"evaluation reports: {', '.join(reported)})"
            )


TRAIN_SECTIONS = (RunSection, DataSection, LaunchSection, DataParallelSection, LoopSection, OptimSection)


class TrainConfig(TrainJob, sections=TRAIN_SECTIONS):
    """Every platform section: the config of a plain data-parallel training job (and of the trainer's
    tests)."""
