"""`parallelize_pipeline`: model parallel (pipeline stages) x data parallel over a 2-D DeviceMesh
``(dp=G, mp=K)``: global rank ``r = g*K + s`` holds stage ``s`` of group ``g``; gradients are all-reduced
over ``dp`` only (README.md: Data parallel)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from mariana.platform.core.errors import MarianaError
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .schedule import GPipeSchedule, StagePosition, TorchSchedule
from .stages import balanced_boundaries, block_costs_time, split_blocks

_WIRE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SCHEDULES = ("1f1b", "gpipe", "p2p")  # torch.distributed.pipelining 1F1B / GPipe; the hand-written GPipe
log = logging.getLogger("mariana")


class PipelineParallel(StagePosition):
    """This rank's pipeline stage plus the step runner. ``dp_ranks``: the global ranks holding the same stage;
    ``mp_ranks``: this rank's pipeline in stage order; ``schedule``: the hand-written `GPipeSchedule`
    (inference, and the batches `TorchSchedule.supports` refuses); ``last_schedule``: which one ran the last
    training batch; ``comm_seconds``/``comm_bytes``: all-reduce cost since the last `take_comm`."""

    def __init__(
        self,
        stage: nn.Module,
        stage_index: int,
        n_stages: int,
        mesh,
        device: torch.device,
        n_microbatches: int,
        loss_fn: Callable,
        grad_comm: str = "fp32",
        autocast=None,
        schedule: str = "1f1b",
    ):
        if schedule not in SCHEDULES:
            raise MarianaError(f"unknown pipeline schedule {schedule!r}: use {', '.join(SCHEDULES)}")
        self.stage, self.stage_index, self.n_stages = stage, stage_index, n_stages
        self.index = stage_index  # `StagePosition`'s is_first / is_last
        self.mesh, self.device = mesh, device
        self.grad_comm = grad_comm
        if mesh is not None:
            self.dp_group = mesh.get_group("dp")
            self.mp_group = mesh.get_group("mp")
            self.dp_ranks = dist.get_process_group_ranks(self.dp_group)
            self.mp_ranks = dist.get_process_group_ranks(self.mp_group)
            self.dp_index = self.dp_ranks.index(dist.get_rank())
        else:
            self.dp_group = self.mp_group = None
            self.dp_ranks, self.mp_ranks, self.dp_index = [0], [0], 0
        self.dp_size = len(self.dp_ranks)
        prev = self.mp_ranks[stage_index - 1] if stage_index > 0 else None
        nxt = self.mp_ranks[stage_index + 1] if stage_index < n_stages - 1 else None
        self.n_microbatches, self.schedule_name = n_microbatches, schedule
        self.schedule = GPipeSchedule(
            stage, stage_index, n_stages, prev, nxt, n_microbatches, loss_fn, device, autocast
        )
        self.torch_schedule = None
        if schedule != "p2p" and n_stages > 1:
            self.torch_schedule = TorchSchedule(
                schedule,
                stage,
                stage_index,
                n_stages,
                self.mp_group,
                n_microbatches,
                loss_fn,
                device,
                autocast,
            )
        self.last_schedule = ""
        self._warned: set[int] = set()
        self.comm_seconds, self.comm_bytes = 0.0, 0
        if self.dp_size > 1:  # identical replicas: like DDP, start every group from dp rank 0's weights
            for t in [*stage.parameters(), *stage.buffers()]:
                dist.broadcast(t.data, self.dp_ranks[0], group=self.dp_group)

    def parameters(self):
        return self.stage.parameters()

    def train(self, mode: bool = True):
        self.stage.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def run_schedule(self, inputs, targets, batch_size: int) -> torch.Tensor | None:
        """Pipelined forward/backward of one batch (``inputs`` on the first stage, ``targets`` on the last);
        gradients accumulate into ``.grad``; -> the mean loss on the last stage, None elsewhere. Every stage
        picks the same schedule (it depends only on the batch size, M and K)."""
        ts = self.torch_schedule
        if ts is not None and ts.supports(batch_size):
            self.last_schedule = f"{ts.kind} (torch.distributed.pipelining)"
            return ts.train_step(inputs, targets, batch_size)
        if ts is not None and batch_size not in self._warned:
            self._warned.add(batch_size)
            log.info(
                "pipeline: batch of %d in %d micro-batches over %d stages: torch's %s schedule needs "
                "micro-batches >= stages and equal micro-batches; using the hand-written GPipe schedule",
                batch_size,
                min(self.n_microbatches, batch_size),
                self.n_stages,
                ts.kind,
            )
        self.last_schedule = "gpipe (hand-written p2p)"
        return self.schedule.train_step(inputs, targets, batch_size)

    def infer_shapes(self, batch_size: int, inputs: torch.Tensor | None) -> None:
        """Before training, on every rank: `TorchSchedule.infer_shapes`, so no training step infers them."""
        if self.torch_schedule is not None:
            self.torch_schedule.infer_shapes(batch_size, inputs)

    def train_step(self, inputs, targets, batch_size: int) -> torch.Tensor | None:
        """`run_schedule`, then the gradient all-reduce over ``dp``; the caller steps its optimizer."""
        loss = self.run_schedule(inputs, targets, batch_size)
        self.sync_gradients()
        return loss

    def forward(self, inputs, batch_size: int) -> torch.Tensor | None:
        """Pipelined inference; logits on the last stage, None elsewhere."""
        return self.schedule.forward(inputs, batch_size)

    def sync_gradients(self) -> None:
        """Average the stage's gradients over the ``dp`` group (the ranks holding the same stage)."""
        if self.dp_size == 1:
            return
        params = [p for p in self.stage.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        t0 = time.perf_counter()
        flat = _flatten_dense_tensors(grads)
        wire = flat.to(_WIRE[self.grad_comm])
        dist.all_reduce(wire, group=self.dp_group)
        flat = wire.to(flat.dtype).div_(self.dp_size)
        for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
            if p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)
        self.comm_seconds += time.perf_counter() - t0
        self.comm_bytes += wire.numel() * wire.element_size()

    def take_comm(self) -> tuple[float, int]:
        out = (self.comm_seconds, self.comm_bytes)
        self.comm_seconds, self.comm_bytes = 0.0, 0
        return out


def parallelize_pipeline(
    model_or_stages: nn.Sequential | Sequence[nn.Module],
    mesh,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    n_microbatches: int = 4,
    balance: str | Sequence[int] = "params",
    sample: torch.Tensor | None = None,
    grad_comm: str = "fp32",
    autocast=None,
    schedule: str = "1f1b",
) -> PipelineParallel:
    """This rank's stage of ``model_or_stages`` on ``device``, as a `PipelineParallel`.

    ``model_or_stages``: an ``nn.Sequential`` of blocks (the same on every rank), cut into K stages by
    ``balance`` (`stages.split_blocks`), or a list of exactly K stage modules. ``mesh``: 2-D DeviceMesh
    ``("dp", "mp")``, or None for one process (K=1). ``loss_fn(logits, targets)`` -> the mean loss."""
    k = mesh["mp"].size() if mesh is not None else 1
    s = mesh["mp"].get_local_rank() if mesh is not None else 0
    if isinstance(model_or_stages, nn.Sequential):
        if balance == "time" and k > 1:
            # every rank must cut at the same blocks: average the measured block times over all ranks
            if sample is None:
                raise MarianaError("balance='time' needs a sample input batch")
            costs = torch.tensor(block_costs_time(model_or_stages, sample), dtype=torch.float64)
            if dist.is_initialized():
                dist.all_reduce(costs)
            balance = balanced_boundaries(costs.tolist(), k)
        stages = split_blocks(model_or_stages, k, balance, sample)
    else:
        stages = list(model_or_stages)
        if len(stages) != k:
            raise MarianaError(f"got {len(stages)} stage modules for a mesh with {k} pipeline stages")
    if n_microbatches < 1:
        raise MarianaError(f"--micro-batches must be >= 1, got {n_microbatches}")
    stage = stages[s].to(device)
    return PipelineParallel(stage, s, k, mesh, device, n_microbatches, loss_fn, grad_comm, autocast, schedule)
