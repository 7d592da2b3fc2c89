"""The one training loop every data-parallel job uses.

`Trainer.fit` runs optimizer steps over a `BatchLoader` with gradient accumulation (DDP ``no_sync`` on
all but the last micro-step), bf16 autocast on GPU, gradient clipping, an LR schedule, periodic
evaluation and checkpoints, a tqdm bar on rank 0, and ``metrics.jsonl`` records. With ``cfg.resume`` (or
when torchrun restarts the worker group) it continues from the last checkpoint exactly: model, optimizer,
scheduler, data position ``(epoch, batch)`` and RNG states.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from tqdm import tqdm

from .checkpoint import load_checkpoint, save_checkpoint, set_rng_state
from .config import TrainConfig
from .errors import MarianaError
from .faults import FaultInjector
from .optim import build_optimizer, build_scheduler
from .rundir import RunDir

log = logging.getLogger("mariana")

StepFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, int]]
EvalFn = Callable[[torch.nn.Module], dict[str, float]]


class BatchLoader(Protocol):
    """A resumable source of batches for one rank."""

    batches_per_epoch: int

    def iterate(self, epoch: int, start: int) -> Iterator[Any]:
        """This rank's batches of ``epoch`` from batch index ``start`` on (deterministic per epoch)."""
        ...


def move_to(batch: Any, device: torch.device) -> Any:
    """Recursively move tensors in tuples/lists/dicts to ``device`` (non-blocking from pinned memory)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(move_to(v, device) for v in batch)
    return batch


def autocast_for(cfg: TrainConfig, device: torch.device):
    use = cfg.amp == "bf16" or (cfg.amp == "auto" and device.type == "cuda")
    if not use:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def total_steps(cfg: TrainConfig, batches_per_epoch: int) -> int:
    """Optimizer steps of the run: ``--max-steps``, or ``--epochs`` x full accumulation groups per epoch.
    MarianaError if one epoch has no complete optimizer step (too little data for the batch size)."""
    if batches_per_epoch < cfg.grad_accum:
        raise MarianaError(
            f"one epoch has {batches_per_epoch} batches per worker, fewer than --grad-accum {cfg.grad_accum}: "
            f"the training data is too small for --batch-size {cfg.batch_size} x --workers {cfg.workers}; "
            "use a smaller --batch-size or fewer --workers"
        )
    return cfg.max_steps or cfg.epochs * (batches_per_epoch // cfg.grad_accum)


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any | None,
        loader: BatchLoader,
        step_fn: StepFn,
        ctx,
        run: RunDir,
        eval_fn: EvalFn | None = None,
    ):
        self.cfg, self.model, self.loader, self.step_fn = cfg, model, loader, step_fn
        self.ctx, self.run, self.eval_fn = ctx, run, eval_fn
        self.total_steps = total_steps(cfg, loader.batches_per_epoch)
        self.optimizer = optimizer or build_optimizer(cfg, model.parameters())
        self.scheduler = scheduler or build_scheduler(cfg, self.optimizer, self.total_steps)
        self.step, self.epoch, self.pos = 0, 0, 0
        self.faults = FaultInjector()
        if ctx.watchdog is not None:
            ctx.watchdog.report_dir = run.log_dir

    # --- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "data": {"epoch": self.epoch, "batch": self.pos},
        }

    def save(self) -> None:
        self.ctx.set_phase("checkpoint")
        save_checkpoint(
            self.run,
            self.step,
            self.state_dict() if self.ctx.is_main else None,
            self.ctx.rank,
            self.ctx.barrier,
        )
        if self.ctx.is_main:
            log.debug("checkpoint at step %d written to %s", self.step, self.run.ckpt_dir)

    def maybe_resume(self) -> None:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        if not (self.cfg.resume or restarted):
            return
        if not self.run.has_checkpoint():
            if self.cfg.resume and not restarted:
                raise MarianaError(f"--resume: no checkpoint in {self.run.ckpt_dir}")
            return  # restarted before the first checkpoint: start over
        state, rng = load_checkpoint(self.run, self.ctx.rank)
        unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.pos = state["step"], state["data"]["epoch"], state["data"]["batch"]
        if rng is not None:
            set_rng_state(rng)
        if self.ctx.is_main:
            log.info(
                "resumed from step %d (epoch %d, batch %d)%s",
                self.step,
                self.epoch,
                self.pos,
                " after a worker restart" if restarted else "",
            )

    # --- evaluation ------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        if self.eval_fn is None:
            return {}
        if self.ctx.watchdog is not None:
            self.ctx.watchdog.disarm()  # evaluation has no collectives and may be long
        self.model.eval()
        with torch.no_grad(), autocast_for(self.cfg, self.ctx.device):
            metrics = self.eval_fn(unwrap(self.model))
        self.model.train()
        return {k: float(v) for k, v in metrics.items()}

    # --- the loop --------------------------------------------------------------------------------------
    def _next_batch(self, it: Iterator[Any] | None) -> tuple[Any, Iterator[Any]]:
        while True:
            if it is None:
                it = iter(self.loader.iterate(self.epoch, self.pos))
            try:
                batch = next(it)
                self.pos += 1
                return batch, it
            except StopIteration:
                self.epoch, self.pos, it = self.epoch + 1, 0, None

    def _global_mean(self, value: torch.Tensor) -> float:
        if self.ctx.distributed:
            value = value.clone()
            dist.all_reduce(value)
            value /= self.ctx.world_size
        return float(value)

    def fit(self) -> dict[str, Any]:
        cfg, ctx, model = self.cfg, self.ctx, self.model
        self.maybe_resume()
        model.train()
        comm = getattr(model, "comm_stats", None)
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            disable=not (ctx.is_main and cfg.progress),
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0,
            file=sys.stderr,
        )
        it = None
        loss_sum = torch.zeros((), device=ctx.device)
        interval_samples, interval_steps, last_log = 0, 0, time.perf_counter()
        start_time, start_step, total_samples = time.perf_counter(), self.step, 0
        last_loss = float("nan")
        eval_metrics: dict[str, float] = {}
        while self.step < self.total_steps:
            self.faults.maybe_fire(self.step + 1)
            ctx.beat(self.step + 1, "data")
            for micro in range(cfg.grad_accum):
                batch, it = self._next_batch(it)
                batch = move_to(batch, ctx.device)
                ctx.set_phase("compute")
                sync = micro == cfg.grad_accum - 1 or not hasattr(model, "no_sync")
                with contextlib.nullcontext() if sync else model.no_sync():
                    with autocast_for(cfg, ctx.device):
                        loss, n = self.step_fn(model, batch)
                    (loss / cfg.grad_accum).backward()
                loss_sum += loss.detach().float() / cfg.grad_accum
                interval_samples += n
            ctx.set_phase("optim")
            if cfg.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            interval_steps += 1
            bar.update(1)

            if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize()
                now = time.perf_counter()
                last_loss = self._global_mean(loss_sum / interval_steps)
                samples = interval_samples * ctx.world_size
                total_samples += samples
                comm_s, comm_bytes = comm.take() if comm is not None else (0.0, 0)
                record = {
                    "step": self.step,
                    "epoch": self.epoch,
                    "loss": last_loss,
                    "samples_per_s": samples / (now - last_log),
                    "step_time_s": (now - last_log) / interval_steps,
                    "comm_time_s": comm_s / interval_steps,
                    "comm_bytes": comm_bytes // interval_steps,
                    "lr": self.scheduler.get_last_lr()[0],
                }
                if ctx.is_main:
                    self.run.log_metrics(record)
                    bar.set_postfix(loss=f"{last_loss:.4f}", sps=f"{record['samples_per_s']:.0f}")
                loss_sum.zero_()
                interval_samples, interval_steps, last_log = 0, 0, time.perf_counter()
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < self.total_steps:
                eval_metrics = self.evaluate()
                if ctx.is_main:
                    self.run.log_metrics(
                        {"step": self.step, **{f"eval_{k}": v for k, v in eval_metrics.items()}}
                    )
                    log.info("step %d eval %s", self.step, eval_metrics)
            if cfg.ckpt_every and self.step % cfg.ckpt_every == 0 and self.step < self.total_steps:
                self.save()
        bar.close()
        wall = time.perf_counter() - start_time
        self.save()
        eval_metrics = self.evaluate()
        final = {
            "steps": self.step,
            "train_loss": last_loss,
            "samples_per_s": total_samples / wall if wall > 0 and self.step > start_step else 0.0,
            "wall_time_s": wall,
            "world_size": ctx.world_size,
            **{f"eval_{k}": v for k, v in eval_metrics.items()},
        }
        if ctx.is_main:
            self.run.log_metrics({"step": self.step, **{f"eval_{k}": v for k, v in eval_metrics.items()}})
            self.run.write_final(final)
        if ctx.watchdog is not None:
            ctx.watchdog.disarm()
        return final
