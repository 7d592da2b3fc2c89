"""Config of ``mariana vision train`` (flat dataclass; every field is a ``--kebab-case`` flag)."""

from __future__ import annotations

from dataclasses import dataclass

from mariana.platform.core.config import TrainConfig, opt
from mariana.platform.core.errors import MarianaError


@dataclass
class VisionConfig(TrainConfig):
    model: str = opt(
        "cifar-fast",
        "model: cifar-fast, resnet9, mariana-cnn, mariana-cnn-32 or a torchvision name (resnet18, alexnet, ...)",
    )
    image_size: int = opt(32, "input size in pixels (images are resized/cropped to SxS)")
    model_parallel: int = opt(
        1, "pipeline stages per data-parallel group (--workers must be divisible by it)"
    )
    micro_batches: int = opt(4, "micro-batches per batch in the pipeline schedule (model parallel > 1)")
    stage_balance: str = opt(
        "params", "how to cut the model into stages: params, time, or block indices '3,6'"
    )
    eval_data: str = opt(
        "", "held-out images (.tar or folder) evaluated at the end (and every --eval-every steps)"
    )
    limit: int = opt(0, "use a class-balanced random subset of N training images (0 = all)")
    eval_limit: int = opt(0, "evaluate on the first N held-out images of a fixed random order (0 = all)")
    augment: str = opt(
        "flip-crop",
        "training augmentation on the batch (on the GPU when training there)",
        ["flip-crop", "flip", "none"],
    )
    cache: str = opt(
        "auto",
        "decode the data set once into memory (auto: when it fits in --cache-gb)",
        ["auto", "on", "off"],
    )
    cache_gb: float = opt(8.0, "memory budget for the decoded-image cache in GB")
    decode: str = opt(
        "auto", "where JPEGs are decoded: auto = GPU when training on CUDA", ["auto", "cpu", "cuda"]
    )
    dropout: float = opt(0.5, "dropout before the fully connected layers of mariana-cnn")
    label_smoothing: float = opt(0.1, "label smoothing of the cross-entropy loss")
    channels_last: bool = opt(True, "channels-last memory format (faster convolutions)")
    compile: bool = opt(False, "torch.compile the model (GPU; longer start-up, faster steps)")

    def validate(self) -> None:
        super().validate()
        if self.model_parallel < 1:
            raise MarianaError(f"--model-parallel must be >= 1, got {self.model_parallel}")
        if (self.workers * self.nnodes) % self.model_parallel:
            raise MarianaError(
                f"--workers {self.workers * self.nnodes} is not divisible by --model-parallel {self.model_parallel}"
            )
        if self.micro_batches < 1 or self.micro_batches > self.batch_size:
            raise MarianaError(
                f"--micro-batches must be in 1..--batch-size ({self.batch_size}), got {self.micro_batches}"
            )
        if self.image_size < 8:
            raise MarianaError(f"--image-size must be >= 8 pixels, got {self.image_size}")
        if not 0 <= self.label_smoothing < 1 or not 0 <= self.dropout < 1:
            raise MarianaError("--label-smoothing and --dropout must be in [0, 1)")
        if self.stage_balance not in ("params", "time"):
            try:
                [int(x) for x in self.stage_balance.split(",")]
            except ValueError:
                raise MarianaError(
                    f"--stage-balance must be params, time or block indices like '3,6', got {self.stage_balance!r}"
                ) from None


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
    # the CPU accuracy recipe: one epoch, ~50 s on 2 idle cores, ~72 % top-1 on CIFAR-10 test-dev
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
}
