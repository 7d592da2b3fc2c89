"""Optimizer and learning-rate schedule builders from a `TrainConfig`."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from .config import TrainConfig


def fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether PyTorch's fused optimizer kernels take ``params``: floating-point CPU or CUDA tensors."""
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def build_optimizer(cfg: TrainConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer named by ``cfg.optimizer`` (sgd | adam | adamw) over the trainable ``params``.

    Uses PyTorch's fused kernels (one pass over each parameter instead of one per arithmetic op) when every
    parameter is a floating-point CPU or CUDA tensor, which steps faster than the default multi-tensor
    kernels (`platform/README.md`, "Measured choices")."""
    params = [p for p in params if p.requires_grad]
    kw = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    if fused_supported(params):
        kw["fused"] = True
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, momentum=cfg.momentum, **kw)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, **kw)
    return torch.optim.AdamW(params, **kw)


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based): linear warm-up, then the schedule."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    raise ValueError(f"unknown schedule {schedule!r}")


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    """A LambdaLR (its state_dict holds only the step count, so checkpoints stay tensors + numbers)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, cfg.warmup_steps, cfg.schedule)
    )
