"""`PipelineStep`: the core `Trainer`'s step (`mariana.platform.core.steps.TrainStep`) for pipeline-parallel
jobs (README.md: "Step"). No rank holds the whole model, so the step, not the loop, runs the optimizer step,
averages the loss, checkpoints per stage and assembles the full model for export."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mariana.platform.core.atomic import atomic_torch_save, atomic_write_text
from mariana.platform.core.config import TrainConfig
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.optim import build_optimizer, build_scheduler
from mariana.platform.core.rundir import RunDir

from .parallelize import PipelineParallel
from .stages import optimizer_state_bytes, param_bytes

# One pipeline micro-batch as the loader yields it: (inputs or None, targets or None, batch size); the first
# stage needs the inputs, the last the targets, every stage the batch size (to agree on micro-batches).
PipelineBatch = tuple[Any, Any, int]


class PipelineStep:
    """One rank's part of a pipeline job's optimizer steps. ``prepare``: applied to the stage-0 inputs on the
    device. ``example``: (batch size, a loader batch of inputs on the first stage, None on the others): its
    shapes are fixed in `setup`, not in a training step (a collective: give it on every rank or on none)."""

    def __init__(
        self,
        cfg: TrainConfig,
        pp: PipelineParallel,
        ctx,
        run: RunDir,
        prepare: Callable[[Any], Any] | None = None,
        example: tuple[int, Any] | None = None,
    ):
        self.cfg, self.pp, self.ctx, self.run = cfg, pp, ctx, run
        self.example = example
        self.prepare = prepare or (lambda x: x)
        self.data_parallel = pp.dp_size
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.step_times: list[float] = []
        self.reported = False

    def setup(self, total_steps: int) -> None:
        self.optimizer = build_optimizer(self.cfg, self.pp.parameters())
        self.scheduler = build_scheduler(self.cfg, self.optimizer, total_steps)
        self.pp.train()
        if self.example is not None:
            bsz, inputs = self.example
            if inputs is not None:  # prepared as the step prepares them (the first stage's input dtype);
                # the RNG state restored after, so the run draws what it drew without this
                devices = [self.ctx.device] if self.ctx.device.type == "cuda" else []
                with torch.random.fork_rng(devices=devices):
                    inputs = self.prepare(inputs.to(self.ctx.device))
            self.pp.infer_shapes(bsz, inputs)

    # --- the step --------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[PipelineBatch]) -> tuple[torch.Tensor, int]:
        cfg, ctx, pp = self.cfg, self.ctx, self.pp
        t0 = time.perf_counter()
        k = len(micro_batches)
        loss_sum = torch.zeros((), device=ctx.device)
        samples = 0
        for inputs, targets, bsz in micro_batches:
            if inputs is not None:
                inputs = self.prepare(inputs.to(ctx.device, non_blocking=True))
            if targets is not None:
                targets = targets.to(ctx.device, non_blocking=True)
            ctx.set_phase("compute")
            loss = pp.run_schedule(inputs, targets, bsz)
            if loss is not None:  # the last stage
                loss_sum += loss.float() / k
            samples += bsz
        ctx.set_phase("comm")
        if k > 1:
            for p in pp.parameters():
                if p.grad is not None:
                    p.grad.div_(k)
        pp.sync_gradients()
        ctx.set_phase("optim")
        if cfg.clip_grad > 0:
            self.clip_gradients(cfg.clip_grad)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        self.step_times.append(time.perf_counter() - t0)
        if not self.reported:
            self.write_memory_report()
            self.reported = True
        return loss_sum, samples

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Scale the stage's gradients so that the whole model's gradient norm is at most ``max_norm``
        (as `torch.nn.utils.clip_grad_norm_` on the unsplit model): the squared stage norms are summed over
        the pipeline group. Returns the total norm before clipping."""
        pp = self.pp
        grads = [p.grad for p in pp.parameters() if p.grad is not None]
        sq = torch.zeros((), device=self.ctx.device, dtype=torch.float32)
        if grads:
            sq = torch.stack([torch.linalg.vector_norm(g.detach().float()) ** 2 for g in grads]).sum()
        if self.ctx.distributed and pp.n_stages > 1:
            dist.all_reduce(sq, group=pp.mp_group)
        total = sq.sqrt()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
        return total

    def mean_loss(self, loss_sum: torch.Tensor, steps: int) -> float:
        """Mean loss over the dp groups: only last stages contribute (the others add zero)."""
        t = (loss_sum / max(1, steps)).reshape(1).float()
        if self.ctx.distributed:
            dist.all_reduce(t)
        return float(t) / self.pp.dp_size

    def evaluate(self, fn: Callable[[Any], dict[str, float]]) -> dict[str, float]:
        """``fn(pp)`` in eval mode without gradients (a collective: every rank calls ``fn``)."""
        self.pp.eval()
        try:
            with torch.no_grad():
                return fn(self.pp)
        finally:
            self.pp.train()

    # --- checkpoints -----------------------------------------------------------------------------------
    def _stage_file(self, folder: Path) -> Path:
        return Path(folder) / f"stage-{self.pp.stage_index}.pt"

    def checkpoint_state(self, folder: Path) -> dict[str, Any]:
        if self.pp.dp_index == 0:
            atomic_torch_save(
                {
                    "model": self.pp.stage.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                },
                self._stage_file(folder),
            )
        return {"pipeline": {"stages": self.pp.n_stages, "groups": self.pp.dp_size}}

    def restore(self, state: dict[str, Any], folder: Path) -> None:
        stages = (state.get("pipeline") or {}).get("stages")
        if stages != self.pp.n_stages:
            raise MarianaError(
                f"--resume: the checkpoint in {Path(folder).parent} has {stages} pipeline stages, this job has "
                f"{self.pp.n_stages} (use the same --model-parallel)"
            )
        path = self._stage_file(folder)
        if not path.is_file():
            raise MarianaError(f"--resume: the checkpoint {folder} has no {path.name}")
        st = torch.load(path, map_location="cpu", weights_only=True)
        self.pp.stage.load_state_dict(st["model"])
        self.optimizer.load_state_dict(st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict (CPU tensors) on rank 0, ``{}`` elsewhere. A collective: every rank
        calls it; the stages of data-parallel group 0 send their state dicts to rank 0 (its stage 0)."""
        pp, ctx = self.pp, self.ctx
        local = {k: v.detach().cpu() for k, v in pp.stage.state_dict().items()}
        if not ctx.distributed or pp.n_stages == 1:
            return local if ctx.is_main else {}
        if pp.dp_index != 0:
            return {}
        parts: list[Any] | None = [None] * pp.n_stages if ctx.rank == pp.mp_ranks[0] else None
        dist.gather_object(local, parts, dst=pp.mp_ranks[0], group=pp.mp_group)
        if not ctx.is_main:
            return {}
        return {k: v for part in parts or [] for k, v in part.items()}

    # --- reports ---------------------------------------------------------------------------------------
    def lrs(self) -> dict[str, float]:
        return {"lr": self.scheduler.get_last_lr()[0]}

    def comm_stats(self) -> tuple[float, int]:
        return self.pp.take_comm()

    def write_memory_report(self) -> dict[str, Any]:
        """RUN/logs/pipeline-rank-R.json: this rank's stage, gradient group and parameter/optimizer bytes."""
        pp = self.pp
        rep = {
            "rank": self.ctx.rank,
            "stage": pp.stage_index,
            "n_stages": pp.n_stages,
            "dp_index": pp.dp_index,
            "dp_ranks": pp.dp_ranks,
            "mp_ranks": pp.mp_ranks,
            "blocks": list(pp.stage._modules.keys()),
            "param_count": sum(p.numel() for p in pp.stage.parameters()),
            "param_bytes": param_bytes(pp.stage),
            "optimizer_state_bytes": optimizer_state_bytes(self.optimizer),
            "schedule": pp.last_schedule,
        }
        if self.ctx.device.type == "cuda":
            rep["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.ctx.device)
        atomic_write_text(
            self.run.log_dir / f"pipeline-rank-{self.ctx.rank}.json", json.dumps(rep, indent=2) + "\n"
        )
        return rep

    def summary(self) -> dict[str, Any]:
        """Pipeline facts for ``metrics.json``; ``step_time_s`` is the mean of this run's steps after the
        first (which includes lazy set-up: allocations, P2P links, torch's shape inference)."""
        steady = self.step_times[1:] or self.step_times
        return {
            "model_parallel": self.pp.n_stages,
            "data_parallel": self.pp.dp_size,
            "micro_batches": self.pp.n_microbatches,
            "pipeline_schedule": self.pp.last_schedule or self.pp.schedule_name,
            "step_time_s": sum(steady) / len(steady) if steady else 0.0,
        }
