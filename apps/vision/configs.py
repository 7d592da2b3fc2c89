"""Config of ``mariana vision train``: the platform's training sections plus the held-out evaluation, the
network, the pipeline (model parallelism) and the training recipe; presets ``debug``, ``small``, ``gpu94``,
``fast``. Standard library only (the parser module imports it under ``mariana vision --help``); the model
checks of `VisionConfig.check` import the model code when a config is validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mariana.platform.core.config import (
    RESUME_MAY_CHANGE,
    DataParallelSection,
    DataSection,
    LaunchSection,
    LoopSection,
    OptimSection,
    RunSection,
    Section,
    TrainJob,
    at_least,
    at_least_one,
    given,
    only,
    opt,
    when,
)
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.tracking import TrackingSection

MARIANA_CNNS = ("mariana-cnn", "mariana-cnn-32")  # the models with a dropout layer (--dropout)
# `when` clauses with explicit witnesses: --model and --model-parallel have no choices to draw "another
# value" from
WITH_DROPOUT = when(
    "model",
    lambda cfg: cfg.model in MARIANA_CNNS,
    "--model mariana-cnn/mariana-cnn-32 only",
    MARIANA_CNNS[0],
    "cifar-fast",
)
ONE_STAGE = when("model_parallel", lambda cfg: cfg.model_parallel == 1, "--model-parallel 1 only", 1, 2)


@dataclass
class VisionData(DataSection):
    """An ImageFolder tar/folder, how much of it is used, and whether it is decoded once into memory."""

    data: str = opt("", "training images: a .tar shard or a folder [split/]CLASS/NAME.jpg", path=True)
    limit: int = opt(0, "use a class-balanced random subset of N training images (0 = all)")
    cache: str = opt(
        "auto",
        "decode the data set once into memory (auto: when it fits in --cache-gb)",
        ["auto", "on", "off"],
    )
    cache_gb: float = opt(
        8.0, "memory budget for the decoded-image cache in GB", applies=only("cache", "auto")
    )
    decode: str = opt(
        "auto", "where JPEGs are decoded: auto = GPU when training on CUDA", ["auto", "cpu", "cuda"]
    )

    def validate(self) -> None:
        if self.limit < 0:
            raise MarianaError(f"--limit must be >= 0 images (0 = all), got {self.limit}")
        if self.cache_gb <= 0:
            raise MarianaError(f"--cache-gb must be > 0, got {self.cache_gb}")


@dataclass
class VisionEval(Section):
    """The held-out images scored during and at the end of training."""

    NAME: ClassVar[str] = "heldout"
    TITLE: ClassVar[str] = "held-out evaluation"

    eval_data: str = opt(
        "", "held-out images (.tar or folder) evaluated at the end (and every --eval-every steps)", path=True
    )
    eval_limit: int = opt(
        0,
        "evaluate on the first N held-out images of a fixed random order (0 = all)",
        applies=given("eval_data"),
    )
    eval_tta: str = opt(
        "none",
        "test-time augmentation of the evaluations during training: none, flip (2 views) or crops "
        "(flip + 1 px translations: 6 views); the mean of the views' probabilities",
        ["none", "flip", "crops"],
        applies=(given("eval_data"), ONE_STAGE),
    )

    def validate(self) -> None:
        if self.eval_limit < 0:
            raise MarianaError(f"--eval-limit must be >= 0 images (0 = all), got {self.eval_limit}")


@dataclass
class VisionOptim(OptimSection):
    """`OptimSection` whose schedule the fast recipe replaces with its own triangular one."""

    schedule: str = opt(
        "constant",
        "learning-rate schedule after warm-up",
        ["constant", "cosine", "linear"],
        applies=only("recipe", "standard"),
    )
    warmup_steps: int = opt(0, "linear warm-up steps", applies=only("recipe", "standard"))


@dataclass
class VisionNet(Section):
    """The classifier and its training recipe."""

    NAME: ClassVar[str] = "net"
    TITLE: ClassVar[str] = "network and recipe"

    model: str = opt(
        "cifar-fast",
        "model: fastnet, cifar-fast, resnet9, mariana-cnn, mariana-cnn-32 or a torchvision name (resnet18, "
        "alexnet, ...)",
    )
    image_size: int = opt(32, "input size in pixels (images are resized/cropped to SxS)")
    dropout: float = opt(
        0.5, "dropout before the fully connected layers of mariana-cnn", applies=WITH_DROPOUT
    )
    recipe: str = opt(
        "standard",
        "optimizer recipe: standard (--optimizer, --schedule) or fast (model fastnet: Nesterov SGD, BN biases "
        "at 64x LR, triangular LR, Lookahead weight averaging; apps/vision/fast_recipe.py)",
        ["standard", "fast"],
    )
    augment: str = opt(
        "flip-crop",
        "training augmentation on the batch (on the GPU when training there); alt-flip-translate: one "
        "random flip per image, all flipped every other epoch, random 2 px translation (decoded set only)",
        ["flip-crop", "flip", "none", "alt-flip-translate"],
    )
    label_smoothing: float = opt(0.1, "label smoothing of the cross-entropy loss")
    channels_last: bool = opt(True, "channels-last memory format (faster convolutions)")
    compile: bool = opt(
        False, "torch.compile the model (GPU; longer start-up, faster steps)", applies=ONE_STAGE
    )

    def validate(self) -> None:
        if self.image_size < 8:
            raise MarianaError(f"--image-size must be >= 8 pixels, got {self.image_size}")
        if not 0 <= self.label_smoothing < 1 or not 0 <= self.dropout < 1:
            raise MarianaError("--label-smoothing and --dropout must be in [0, 1)")
        if self.recipe == "fast" and self.model != "fastnet":
            raise MarianaError(f"--recipe fast trains --model fastnet only, got --model {self.model}")


@dataclass
class VisionPipeline(Section):
    """Pipeline model parallelism: --model-parallel K stages per data-parallel group."""

    NAME: ClassVar[str] = "pipeline"
    TITLE: ClassVar[str] = "pipeline model parallelism"

    model_parallel: int = opt(
        1, "pipeline stages per data-parallel group (--workers must be divisible by it)"
    )
    micro_batches: int = opt(
        4,
        "micro-batches per batch in the pipeline schedule",
        applies=at_least("model_parallel", 2, workers=2),
    )
    stage_balance: str = opt(
        "params",
        "how to cut the model into stages: params, time, or block indices '3,6'",
        applies=at_least("model_parallel", 2, workers=2),
    )
    pipeline_schedule: str = opt(
        "1f1b",
        "pipeline schedule (torch.distributed.pipelining): 1f1b (one forward, one backward: at most K "
        "micro-batches' activations alive) or gpipe (all forwards, then all backwards); same gradients",
        ["1f1b", "gpipe"],
        applies=at_least("model_parallel", 2, workers=2),
    )

    def validate(self) -> None:
        at_least_one(self, ("model_parallel", "micro_batches"))


VISION_SECTIONS = (
    RunSection,
    VisionData,
    VisionEval,
    LaunchSection,
    DataParallelSection,
    LoopSection,
    VisionOptim,
    VisionNet,
    VisionPipeline,
    TrackingSection,
)


class VisionConfig(TrainJob, sections=VISION_SECTIONS):
    """``mariana vision train``."""

    EVAL_METRICS: ClassVar[tuple[str, ...]] = ("top1", "top5")
    VALIDATION: ClassVar[tuple] = (given("eval_data"),)  # vision evaluates --eval-data only
    # Held-out data may move between a run and its resume (only the scores depend on it); the pipeline
    # schedule may change too (the same gradients in another order of work).
    RESUME_MAY_CHANGE: ClassVar[frozenset[str]] = RESUME_MAY_CHANGE | {
        "eval_data",
        "eval_limit",
        "pipeline_schedule",
        "eval_tta",
    }

    def check(self) -> None:
        """Checks across sections (workers vs stages, recipe vs optimizer and pipeline, augmentation vs
        cache), then the model name and stage cut (`_validate_model`)."""
        super().check()
        k = self.model_parallel
        if (self.workers * self.nnodes) % k:
            raise MarianaError(
                f"--workers {self.workers * self.nnodes} is not divisible by --model-parallel {k}"
            )
        if k > 1 and self.micro_batches > self.batch_size:
            raise MarianaError(
                f"--micro-batches must be in 1..--batch-size ({self.batch_size}), got {self.micro_batches}"
            )
        if self.recipe == "fast" and k > 1:
            raise MarianaError(
                "--recipe fast runs data parallel only (--model-parallel 1): its Lookahead averaging and "
                "per-group learning rates live in the data-parallel step, not in the pipeline's stages"
            )
        if self.recipe == "fast" and self.optimizer != "sgd":
            raise MarianaError("--recipe fast uses Nesterov SGD: set --optimizer sgd")
        if self.augment == "alt-flip-translate" and k > 1:
            raise MarianaError("--augment alt-flip-translate runs data parallel only (--model-parallel 1)")
        if self.augment == "alt-flip-translate" and self.cache == "off":
            raise MarianaError(
                "--augment alt-flip-translate needs the decoded set in memory (--cache auto|on)"
            )
        if k > 1 and self.compile:  # e.g. from a preset (gpu94): pipeline stages run eagerly
            raise MarianaError("--compile applies to --model-parallel 1 only (pipeline stages run eagerly)")
        if k > 1 and self.eval_tta != "none":
            raise MarianaError(
                "--eval-tta applies to --model-parallel 1 only (pipeline evaluations use one view)"
            )
        self._validate_model()

    def _validate_model(self) -> None:
        """``--model`` and ``--stage-balance`` checked in the launching process, before any worker starts
        (otherwise every worker fails on its own). Cutting into stages needs the model's blocks, so with
        --model-parallel > 1 the model is built here once (on the CPU, not trained)."""
        from .model import MARIANA_MODELS, as_blocks, build_model

        bounds: list[int] = []
        if self.stage_balance not in ("params", "time"):
            try:
                bounds = [int(x) for x in self.stage_balance.split(",")]
            except ValueError:
                raise MarianaError(
                    f"--stage-balance must be params, time or block indices like '3,6', got {self.stage_balance!r}"
                ) from None
        k = self.model_parallel
        if k == 1:
            if self.model not in MARIANA_MODELS:
                build_model(self.model, 10, self.image_size, self.dropout)  # unknown name -> MarianaError
            return
        n = len(as_blocks(build_model(self.model, 10, self.image_size, self.dropout)))
        if n < k:
            raise MarianaError(
                f"--model-parallel {k}: --model {self.model} has only {n} blocks to cut into stages"
            )
        if self.stage_balance in ("params", "time"):
            return
        if len(bounds) != k - 1 or len(set(bounds)) != len(bounds) or min(bounds) < 1 or max(bounds) >= n:
            what = "1 block index" if k == 2 else f"{k - 1} distinct block indices"
            where = "stage 2 starts" if k == 2 else f"stages 2..{k} start"
            raise MarianaError(
                f"--stage-balance {self.stage_balance!r}: --model-parallel {k} needs {what} in 1..{n - 1} "
                f"(where {where}; --model {self.model} has {n} blocks)"
            )


PRESETS = {
    # tiny and fast: CLI / pipeline tests
    "debug": VisionConfig(
        model="cifar-fast",
        batch_size=16,
        limit=256,
        max_steps=4,
        log_every=2,
        eval_limit=200,
        lr=0.05,
        optimizer="sgd",
        weight_decay=5e-4,
    ),
    # the CPU accuracy recipe: one epoch (time and top-1 measured in apps/vision/README.md)
    "small": VisionConfig(
        model="cifar-fast",
        batch_size=128,
        epochs=1,
        limit=0,
        lr=0.2,
        optimizer="sgd",
        momentum=0.9,
        weight_decay=5e-4,
        schedule="linear",
        warmup_steps=50,
        augment="flip",
        log_every=20,
    ),
    # the GPU recipe for the time-to-94 % goal: ResNet-9 as in the DAWNBench CIFAR-10 entries (24 epochs,
    # batch 512, LR 0->0.4 over 5 epochs then linearly to 0, flip + 4 px crop), bf16 autocast, compile
    "gpu94": VisionConfig(
        model="resnet9",
        batch_size=512,
        epochs=24,
        lr=0.4,
        optimizer="sgd",
        momentum=0.9,
        weight_decay=5e-4,
        schedule="linear",
        warmup_steps=480,
        label_smoothing=0.2,
        log_every=50,
        compile=True,
        progress=False,
    ),
    # the GPU default: the fast recipe's flags (the recipe itself, read top to bottom: apps/vision/
    # fast_recipe.py); lr and weight decay are the paper's 11.5 and 0.0153 per 1024 images converted to a
    # mean loss: lr = 11.5 / (1 + 1/(1-0.85)), weight decay (SGD's coupled form) = 0.0153 / 11.5
    "fast": VisionConfig(
        model="fastnet",
        recipe="fast",
        batch_size=1024,
        epochs=10,
        lr=1.5,
        optimizer="sgd",
        momentum=0.85,
        weight_decay=0.0153 / 11.5,
        augment="alt-flip-translate",
        label_smoothing=0.2,
        eval_tta="crops",
        log_every=50,
        progress=False,
    ),
}
