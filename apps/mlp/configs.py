"""Config of the MLP smoke-test job (``mariana mlp train``): the platform's training sections plus the
job's data split and model (the worked example of composing sections; standard library only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mariana.platform.core.config import (
    Config,
    DataParallelSection,
    DataSection,
    LaunchSection,
    LoopSection,
    OptimSection,
    RunSection,
    Section,
    TrainJob,
    at_least,
    opt,
)
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.tracking import TrackingSection


@dataclass
class MlpData(DataSection):
    """A libFM file, cut by row order into train | val | test."""

    data: str = opt("", "libFM training data file", path=True)
    val_fraction: float = opt(
        0.1, "fraction of the rows (by order, just before the test rows) held out for validation"
    )
    test_fraction: float = opt(
        0.1, "last fraction of the rows (by order) held out as the test split, never used in training"
    )
    limit: int = opt(0, "use only the first N rows (0 = all)")

    def validate(self) -> None:
        if not 0 < self.val_fraction < 1:
            raise MarianaError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        if not 0 <= self.test_fraction < 1 or self.val_fraction + self.test_fraction >= 1:
            raise MarianaError(
                f"--test-fraction must be in [0, 1) and leave rows to train on (--val-fraction "
                f"{self.val_fraction} + --test-fraction {self.test_fraction} < 1)"
            )
        if self.limit < 0:
            raise MarianaError(f"--limit must be >= 0 (0 = all rows), got {self.limit}")


@dataclass
class MlpModel(Section):
    """Hashed feature embeddings summed per row, then an MLP."""

    NAME: ClassVar[str] = "net"
    TITLE: ClassVar[str] = "the click MLP"

    buckets: int = opt(1 << 14, "hash buckets for feature ids (id mod buckets)")
    embed_dim: int = opt(16, "embedding width per feature id")
    hidden: int = opt(64, "hidden width of the MLP", applies=at_least("layers", 1))
    layers: int = opt(2, "hidden layers")

    def validate(self) -> None:
        if self.buckets < 2 or self.embed_dim < 1 or self.hidden < 1 or self.layers < 0:
            raise MarianaError(
                "--buckets >= 2, --embed-dim >= 1, --hidden >= 1 and --layers >= 0 are required"
            )


MLP_SECTIONS = (RunSection, MlpData, LaunchSection, DataParallelSection, LoopSection, OptimSection, MlpModel)


class MlpConfig(TrainJob, sections=(*MLP_SECTIONS, TrackingSection)):
    """``mariana mlp train``."""

    EVAL_METRICS: ClassVar[tuple[str, ...]] = ("auc", "logloss")


@dataclass
class MlpEvalSection(Section):
    """What to score with which run."""

    NAME: ClassVar[str] = "eval"
    TITLE: ClassVar[str] = "the run and the data to score"

    model: str = opt("", "run directory of a finished `mariana mlp train`", required=True)
    data: str = opt("", "libFM file to score", required=True)
    split: str = opt(
        "all",
        "rows of --data to score: all, or the train/val/test rows of that file as `mlp train` split them "
        "(by row order: train | val | test, the run's --val-fraction and --test-fraction)",
        ["all", "train", "val", "test"],
    )


class MlpEvalConfig(Config, sections=(MlpEvalSection,)):
    """``mariana mlp eval``."""


PRESETS = {
    "debug": MlpConfig(
        buckets=1 << 12, embed_dim=8, hidden=16, layers=1, batch_size=32, limit=4000, log_every=5
    ),
    "small": MlpConfig(),
}
