"""The training loop for pipeline-parallel jobs (model parallel K > 1).

Why not `mariana.platform.core.loop.Trainer`: it runs ``loss = step_fn(model, batch); loss.backward()`` on
every rank, checkpoints rank 0's full ``model.state_dict()`` and averages the loss over all ranks. A
pipeline step is one collective schedule across stages (no rank holds the whole model, only the last stage
has a loss, the first stage the inputs), so the loop is written here, reusing the core's pieces: config,
`build_optimizer`/`build_scheduler`, `RunDir` metrics records, atomic checkpoint files and the ``latest``
pointer (`save_checkpoint`/`load_checkpoint`), RNG state, the fault injector and the watchdog beats.

Checkpoint layout (in addition to the core's ``state.pt`` with step/data position and ``rng-rank-R.pt``)::

    RUN/checkpoints/step_XXXXXXXX/stage-S.pt   model + optimizer + scheduler state of stage S
                                               (written by dp rank 0 of that stage; replicas are identical)

The stages keep the full model's parameter names, so `merged_state_dict` is a plain union of the files.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from mariana.platform.core.atomic import atomic_torch_save, atomic_write_text
from mariana.platform.core.checkpoint import load_checkpoint, save_checkpoint, set_rng_state
from mariana.platform.core.config import TrainConfig
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.faults import FaultInjector
from mariana.platform.core.loop import total_steps
from mariana.platform.core.optim import build_optimizer, build_scheduler
from mariana.platform.core.rundir import RunDir
from tqdm import tqdm

from .parallelize import PipelineParallel
from .stages import optimizer_state_bytes, param_bytes

log = logging.getLogger("mariana")


class PipelineBatchLoader(Protocol):
    """Per-rank batches of a pipeline job: ``(inputs or None, targets or None, batch_size)``; the first
    stage needs inputs, the last the targets, every stage the batch size (to agree on micro-batches)."""

    batches_per_epoch: int

    def iterate(self, epoch: int, start: int) -> Iterator[tuple[Any, Any, int]]: ...


class PipelineTrainer:
    def __init__(
        self,
        cfg: TrainConfig,
        pp: PipelineParallel,
        loader: PipelineBatchLoader,
        ctx,
        run: RunDir,
        eval_fn: Callable[[PipelineParallel], dict[str, float]] | None = None,
        prepare: Callable[[Any], Any] | None = None,
    ):
        self.cfg, self.pp, self.loader, self.ctx, self.run = cfg, pp, loader, ctx, run
        self.eval_fn = eval_fn
        self.prepare = prepare or (lambda x: x)  # e.g. augmentation + normalisation of stage-0 inputs
        self.total_steps = total_steps(cfg, loader.batches_per_epoch)
        self.optimizer = build_optimizer(cfg, pp.parameters())
        self.scheduler = build_scheduler(cfg, self.optimizer, self.total_steps)
        self.step, self.epoch, self.pos = 0, 0, 0
        self.faults = FaultInjector()
        if ctx.watchdog is not None:
            ctx.watchdog.report_dir = run.log_dir

    # --- checkpoints -----------------------------------------------------------------------------------
    def _stage_file(self, folder) -> Any:
        return folder / f"stage-{self.pp.stage_index}.pt"

    def save(self) -> None:
        self.ctx.set_phase("checkpoint")
        folder = self.run.ckpt_dir / f"step_{self.step:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        if self.pp.dp_index == 0:
            atomic_torch_save(
                {
                    "model": self.pp.stage.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                },
                self._stage_file(folder),
            )
        meta = {
            "step": self.step,
            "data": {"epoch": self.epoch, "batch": self.pos},
            "pipeline": {"stages": self.pp.n_stages, "groups": self.pp.dp_size},
        }
        # the core writes state.pt (rank 0), every rank's RNG, then barrier -> `latest`
        save_checkpoint(
            self.run, self.step, meta if self.ctx.is_main else None, self.ctx.rank, self.ctx.barrier
        )

    def maybe_resume(self) -> None:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        if not (self.cfg.resume or restarted):
            return
        if not self.run.has_checkpoint():
            if self.cfg.resume and not restarted:
                raise MarianaError(f"--resume: no checkpoint in {self.run.ckpt_dir}")
            return
        meta, rng = load_checkpoint(self.run, self.ctx.rank)
        stages = meta.get("pipeline", {}).get("stages")
        if stages != self.pp.n_stages:
            raise MarianaError(
                f"--resume: the checkpoint in {self.run.ckpt_dir} has {stages} pipeline stages, this job has "
                f"{self.pp.n_stages} (use the same --model-parallel)"
            )
        folder = self.run.ckpt_dir / (self.run.ckpt_dir / "latest").read_text().strip()
        st = torch.load(self._stage_file(folder), map_location="cpu", weights_only=True)
        self.pp.stage.load_state_dict(st["model"])
        self.optimizer.load_state_dict(st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        self.step, self.epoch, self.pos = meta["step"], meta["data"]["epoch"], meta["data"]["batch"]
        if rng is not None:
            set_rng_state(rng)
        if self.ctx.is_main:
            log.info(
                "resumed pipeline job from step %d (epoch %d, batch %d)", self.step, self.epoch, self.pos
            )

    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's state dict from the latest checkpoint's stage files (call after `save`)."""
        folder = self.run.ckpt_dir / (self.run.ckpt_dir / "latest").read_text().strip()
        merged: dict[str, torch.Tensor] = {}
        for s in range(self.pp.n_stages):
            merged.update(
                torch.load(folder / f"stage-{s}.pt", map_location="cpu", weights_only=True)["model"]
            )
        return merged

    # --- reports ---------------------------------------------------------------------------------------
    def write_memory_report(self) -> dict[str, Any]:
        """RUN/logs/pipeline-rank-R.json: this rank's stage, gradient group and parameter/optimizer bytes."""
        rep = {
            "rank": self.ctx.rank,
            "stage": self.pp.stage_index,
            "n_stages": self.pp.n_stages,
            "dp_index": self.pp.dp_index,
            "dp_ranks": self.pp.dp_ranks,
            "mp_ranks": self.pp.mp_ranks,
            "blocks": list(self.pp.stage._modules.keys()),
            "param_count": sum(p.numel() for p in self.pp.stage.parameters()),
            "param_bytes": param_bytes(self.pp.stage),
            "optimizer_state_bytes": optimizer_state_bytes(self.optimizer),
        }
        if self.ctx.device.type == "cuda":
            rep["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.ctx.device)
        atomic_write_text(
            self.run.log_dir / f"pipeline-rank-{self.ctx.rank}.json", json.dumps(rep, indent=2) + "\n"
        )
        return rep

    # --- evaluation ------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        if self.eval_fn is None:
            return {}
        if self.ctx.watchdog is not None:
            self.ctx.watchdog.disarm()
        self.pp.eval()
        metrics = self.eval_fn(self.pp)
        self.pp.train()
        return {k: float(v) for k, v in metrics.items()}

    # --- loop ------------------------------------------------------------------------------------------
    def _next_batch(self, it):
        while True:
            if it is None:
                it = iter(self.loader.iterate(self.epoch, self.pos))
            try:
                batch = next(it)
                self.pos += 1
                return batch, it
            except StopIteration:
                self.epoch, self.pos, it = self.epoch + 1, 0, None

    def _world_loss(self, loss_sum: torch.Tensor, steps: int) -> float:
        """Mean loss over the dp groups: only last stages contribute (others add zero)."""
        t = (loss_sum / max(1, steps)).reshape(1).float()
        if self.ctx.distributed:
            dist.all_reduce(t)
        return float(t) / self.pp.dp_size

    def fit(self) -> dict[str, Any]:
        cfg, ctx, pp = self.cfg, self.ctx, self.pp
        self.maybe_resume()
        pp.train()
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            disable=not (ctx.is_main and cfg.progress),
            desc="train (pipeline)",
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0,
            file=sys.stderr,
        )
        it = None
        loss_sum = torch.zeros((), device=ctx.device)
        interval_samples, interval_steps, last_log = 0, 0, time.perf_counter()
        start_time, start_step, total_samples = time.perf_counter(), self.step, 0
        step_times: list[float] = []
        last_loss = float("nan")
        reported = False
        while self.step < self.total_steps:
            self.faults.maybe_fire(self.step + 1)
            ctx.beat(self.step + 1, "data")
            t_step = time.perf_counter()
            for _ in range(cfg.grad_accum):
                (inputs, targets, bsz), it = self._next_batch(it)
                if inputs is not None:
                    inputs = self.prepare(inputs.to(ctx.device, non_blocking=True))
                if targets is not None:
                    targets = targets.to(ctx.device, non_blocking=True)
                ctx.set_phase("compute")
                loss = pp.schedule.train_step(inputs, targets, bsz)
                if loss is not None:
                    loss_sum += loss / cfg.grad_accum
                interval_samples += bsz
            ctx.set_phase("comm")
            if cfg.grad_accum > 1:
                for p in pp.parameters():
                    if p.grad is not None:
                        p.grad.div_(cfg.grad_accum)
            pp.sync_gradients()
            ctx.set_phase("optim")
            if cfg.clip_grad > 0:
                # the global norm spans all stages: sum the squared stage norms over the pipeline group
                norms = [p.grad.detach().float().norm() ** 2 for p in pp.parameters() if p.grad is not None]
                sq = torch.stack(norms).sum() if norms else torch.zeros((), device=ctx.device)
                if ctx.distributed:
                    dist.all_reduce(sq, group=pp.mp_group)
                scale = (cfg.clip_grad / (sq.sqrt() + 1e-6)).clamp(max=1.0)
                for p in pp.parameters():
                    if p.grad is not None:
                        p.grad.mul_(scale)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - t_step)
            self.step += 1
            interval_steps += 1
            bar.update(1)
            if not reported:
                self.write_memory_report()
                reported = True
            if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                now = time.perf_counter()
                last_loss = self._world_loss(loss_sum, interval_steps)
                samples = interval_samples * pp.dp_size
                total_samples += samples
                comm_s, comm_bytes = pp.take_comm()
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
                m = self.evaluate()
                if ctx.is_main:
                    self.run.log_metrics({"step": self.step, **{f"eval_{k}": v for k, v in m.items()}})
            if cfg.ckpt_every and self.step % cfg.ckpt_every == 0 and self.step < self.total_steps:
                self.save()
        bar.close()
        wall = time.perf_counter() - start_time
        self.save()
        eval_metrics = self.evaluate()
        steady = step_times[1:] or step_times  # the first step includes lazy set-up (allocations, P2P links)
        final = {
            "steps": self.step,
            "train_loss": last_loss,
            "samples_per_s": total_samples / wall if wall > 0 and self.step > start_step else 0.0,
            "wall_time_s": wall,
            "step_time_s": sum(steady) / len(steady) if steady else 0.0,
            "world_size": ctx.world_size,
            "model_parallel": pp.n_stages,
            "data_parallel": pp.dp_size,
            "micro_batches": pp.schedule.m,
            **{f"eval_{k}": v for k, v in eval_metrics.items()},
        }
        if ctx.is_main:
            self.run.log_metrics({"step": self.step, **{f"eval_{k}": v for k, v in eval_metrics.items()}})
            self.run.write_final(final)
        if ctx.watchdog is not None:
            ctx.watchdog.disarm()
        return final
