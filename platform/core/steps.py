"""The step a parallel strategy supplies to the one `Trainer` (torchtitan's ``forward_backward_step``).

A step object owns the model (or the local part of it), its optimizer and LR schedule, and knows how to

- ``train_step(micro_batches) -> (loss, samples)``: one optimizer step over ``grad_accum`` micro-batches
  (forward, backward, gradient clipping, optimizer and scheduler step); ``loss`` is this rank's mean loss
  over the micro-batches (a detached 0-d tensor), ``samples`` this rank's sample count;
- ``mean_loss(loss_sum, steps)``: the job-wide mean of the summed per-step losses (a collective where needed);
- ``evaluate(fn)``: run an app's evaluation function on the model, in eval mode and without gradients;
- ``checkpoint_state(folder)`` / ``restore(state, folder)``: what a checkpoint holds besides the Trainer's
  progress (``state.pt`` on rank 0; a strategy may write more files into ``folder``);
- ``lrs()``, ``comm_stats()``, ``data_parallel`` (ranks that see different data, for samples/s).

`ModuleStep` is the step of single-process and data-parallel (DDP) jobs. The pipeline and the
parameter-server frameworks provide their own (`mariana.platform.pipeline.step`, the pCTR steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .config import TrainConfig
from .optim import build_optimizer, build_scheduler

LossFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, int]]


class TrainStep(Protocol):
    data_parallel: int

    def setup(self, total_steps: int) -> None: ...

    def train_step(self, micro_batches: list[Any]) -> tuple[torch.Tensor, int]: ...

    def mean_loss(self, loss_sum: torch.Tensor, steps: int) -> float: ...

    def evaluate(self, fn: Callable[[Any], dict[str, float]]) -> dict[str, float]: ...

    def checkpoint_state(self, folder: Path) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any], folder: Path) -> None: ...

    def lrs(self) -> dict[str, float]: ...

    def comm_stats(self) -> tuple[float, int]: ...


def move_to(batch: Any, device: torch.device) -> Any:
    """Recursively move tensors in tuples/lists/dicts to ``device`` (non-blocking from pinned memory)."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(move_to(v, device) for v in batch)
    if hasattr(batch, "to") and not isinstance(batch, torch.nn.Module):
        return batch.to(device)
    return batch


def autocast_for(cfg: TrainConfig, device: torch.device):
    use = cfg.amp == "bf16" or (cfg.amp == "auto" and device.type == "cuda")
    if not use:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside DDP and ``torch.compile`` wrappers."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


class ModuleStep:
    """Forward/backward/optimizer step of a (possibly DDP-wrapped) ``nn.Module`` on one rank.

    ``loss_fn(model, batch) -> (loss, samples)`` computes one micro-batch's mean loss. Gradients are
    accumulated over the micro-batches (DDP's ``no_sync`` on all but the last, so one all-reduce per step),
    clipped by their global norm (``--clip-grad``), then the optimizer and the scheduler step."""

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module, loss_fn: LossFn, ctx, optimizer=None):
        self.cfg, self.model, self.loss_fn, self.ctx = cfg, model, loss_fn, ctx
        self.optimizer = optimizer
        self.scheduler = None
        self.data_parallel = ctx.world_size
        # The parameters to clip, listed once: walking the module tree every step is ~100 us of Python on a
        # launch-bound GPU step (restores load in place, so the tensors stay the same).
        self.params = list(model.parameters())

    def setup(self, total_steps: int) -> None:
        if self.optimizer is None:
            self.optimizer = build_optimizer(self.cfg, self.model.parameters())
        self.scheduler = build_scheduler(self.cfg, self.optimizer, total_steps)

    def train_step(self, micro_batches: list[Any]) -> tuple[torch.Tensor, int]:
        cfg, ctx, model = self.cfg, self.ctx, self.model
        k = len(micro_batches)
        # One micro-batch (the usual case) adds no kernels: no accumulator and no division by 1, which would
        # be 3-4 launches per step on a GPU where a small model's step is launch-bound (same values: x / 1 = x).
        loss_sum = torch.zeros((), device=ctx.device) if k > 1 else None
        samples = 0
        for i, batch in enumerate(micro_batches):
            batch = move_to(batch, ctx.device)
            ctx.set_phase("compute")
            sync = i == k - 1 or not hasattr(model, "no_sync")
            with contextlib.nullcontext() if sync else model.no_sync():
                with autocast_for(cfg, ctx.device):
                    loss, n = self.loss_fn(model, batch)
                (loss / k if k > 1 else loss).backward()
            if k > 1:
                loss_sum += loss.detach().float() / k
            else:
                loss_sum = loss.detach().float()
            samples += n
        ctx.set_phase("optim")
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.clip_grad)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, samples

    def mean_loss(self, loss_sum: torch.Tensor, steps: int) -> float:
        value = loss_sum / max(1, steps)
        if self.ctx.distributed:
            value = value.clone()
            dist.all_reduce(value)
            value /= self.ctx.world_size
        return float(value)

    def evaluate(self, fn: Callable[[Any], dict[str, float]]) -> dict[str, float]:
        self.model.eval()
        try:
            with torch.no_grad(), autocast_for(self.cfg, self.ctx.device):
                return fn(unwrap(self.model))
        finally:
            self.model.train()

    def checkpoint_state(self, folder: Path) -> dict[str, Any]:
        return {
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def restore(self, state: dict[str, Any], folder: Path) -> None:
        unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def lrs(self) -> dict[str, float]:
        return {"lr": self.scheduler.get_last_lr()[0]}

    def comm_stats(self) -> tuple[float, int]:
        comm = getattr(self.model, "comm_stats", None)
        return comm.take() if comm is not None else (0.0, 0)
