"""Pipeline schedules (how they were chosen: ``platform/pipeline/README.md``): torch.distributed.pipelining's
GPipe and 1F1B (`TorchSchedule`, training) and a hand-written GPipe over point-to-point ops (`GPipeSchedule`:
inference, and the training batches torch's schedules cannot take, B % M != 0 or M < K; same gradients).

`GPipeSchedule`, one step on stage s of K (previous stage on rank ``prev``, next on rank ``next``), M
micro-batches:

    forward  m = 0..M-1:  x_m = recv(prev) (stage 0: input chunk m);  y_m = stage(x_m);  isend(y_m, next)
                          (last stage: loss_m = loss_fn(y_m, target chunk m) * n_m / B)
    backward m = 0..M-1:  g_m = recv(next) (last stage: d loss_m);  y_m.backward(g_m);  isend(x_m.grad, prev)

All forwards precede all backwards, so traffic between two stages flows one way at a time and every rank
posts its P2P ops in its peer's order: NCCL (one ordered stream per communicator) cannot deadlock on
send/send. Each tensor is preceded by a small int64 header (dtype code, ndim, shape): any batch size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8]
_HDR = 10  # dtype, ndim, up to 8 dims
# tags keep activation and gradient streams apart on gloo (NCCL ignores tags; ordering handles it there)
TAG_ACT, TAG_GRAD = 100, 200


class P2P:
    """Tensor send/recv with a shape header between this rank and its pipeline neighbours."""

    def __init__(self, device: torch.device, group=None):
        self.device, self.group = device, group
        self.pending: list = []

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        t = t.detach().contiguous()
        if t.dim() > _HDR - 2:
            raise ValueError(f"pipeline boundary tensors may have at most {_HDR - 2} dims, got {t.dim()}")
        hdr = torch.zeros(_HDR, dtype=torch.int64)
        hdr[0], hdr[1] = _DTYPES.index(t.dtype), t.dim()
        hdr[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        hdr = hdr.to(self.device)
        # keep both tensors alive until the sends complete (wait_all)
        self.pending.append((dist.isend(hdr, dst, group=self.group, tag=tag), hdr))
        self.pending.append((dist.isend(t, dst, group=self.group, tag=tag + 1), t))

    def recv(self, src: int, tag: int) -> torch.Tensor:
        hdr = torch.empty(_HDR, dtype=torch.int64, device=self.device)
        dist.recv(hdr, src, group=self.group, tag=tag)
        h = hdr.tolist()
        shape = h[2 : 2 + h[1]]
        t = torch.empty(shape, dtype=_DTYPES[h[0]], device=self.device)
        dist.recv(t, src, group=self.group, tag=tag + 1)
        return t

    def wait_all(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def _autocast(autocast):
    """The job's autocast context (``autocast()``), or none when ``autocast`` is None."""
    return autocast() if autocast is not None else contextlib.nullcontext()


class StagePosition:
    """Where this rank's stage sits in the pipeline: ``index`` of ``n_stages``."""

    index: int
    n_stages: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1


class GPipeSchedule(StagePosition):
    """One pipeline stage's part of a training or inference step. ``prev_rank``/``next_rank``: global ranks
    of the neighbours (None at the ends); ``loss_fn(logits, targets) -> mean loss`` (last stage only)."""

    def __init__(
        self,
        stage: torch.nn.Module,
        stage_index: int,
        n_stages: int,
        prev_rank: int | None,
        next_rank: int | None,
        n_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        autocast=None,
    ):
        self.stage, self.index, self.n_stages = stage, stage_index, n_stages
        self.prev, self.next = prev_rank, next_rank
        self.m, self.loss_fn, self.device = n_microbatches, loss_fn, device
        self.autocast = autocast
        self.p2p = P2P(device)

    def _chunks(self, t: torch.Tensor | None, n_mb: int, what: str) -> list[torch.Tensor]:
        if t is None:
            raise ValueError(f"pipeline stage {self.index} needs the {what}")
        if t.shape[0] < n_mb:
            raise ValueError(f"batch of {t.shape[0]} is smaller than the {n_mb} micro-batches")
        return list(torch.tensor_split(t, n_mb))

    def train_step(
        self, inputs: torch.Tensor | None, targets: torch.Tensor | None, batch_size: int
    ) -> torch.Tensor | None:
        """Forward + backward of one batch; gradients accumulate into the stage's ``.grad``.
        ``inputs`` on stage 0 ([B, ...]), ``targets`` on the last stage ([B]); ``batch_size`` B on every
        stage (all stages must agree on the number of micro-batches, min(M, B)). Returns the batch's mean
        loss (a detached scalar) on the last stage, None elsewhere."""
        n_mb = min(self.m, batch_size)
        xs = self._chunks(inputs, n_mb, "input batch") if self.is_first else [None] * n_mb
        ts = self._chunks(targets, n_mb, "targets") if self.is_last else [None] * n_mb
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        total = torch.zeros((), device=self.device)
        for i in range(n_mb):
            x = xs[i] if self.is_first else self.p2p.recv(self.prev, TAG_ACT).requires_grad_(True)
            with _autocast(self.autocast):
                y = self.stage(x)
                if self.is_last:
                    y = self.loss_fn(y, ts[i]) * (ts[i].shape[0] / batch_size)
            if self.is_last:
                total += y.detach().float()
            else:
                self.p2p.send(y, self.next, TAG_ACT)
            saved.append((x, y))
        for i in range(n_mb):
            x, y = saved[i]
            if self.is_last:
                y.backward()
            else:
                g = self.p2p.recv(self.next, TAG_GRAD)
                y.backward(g.to(y.dtype))
            if not self.is_first:
                self.p2p.send(x.grad, self.prev, TAG_GRAD)
            saved[i] = None  # type: ignore[call-overload]  # free activations as soon as possible
        self.p2p.wait_all()
        return total if self.is_last else None

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor | None, batch_size: int) -> torch.Tensor | None:
        """Inference through the pipeline: ``inputs`` [B, ...] on stage 0, ``batch_size`` B on every stage;
        returns logits [B, C] (float32) on the last stage, None elsewhere. Micro-batches overlap across
        stages as in training."""
        n_mb = min(self.m, batch_size)
        xs = self._chunks(inputs, n_mb, "input batch") if self.is_first else [None] * n_mb
        outs = []
        for i in range(n_mb):
            x = xs[i] if self.is_first else self.p2p.recv(self.prev, TAG_ACT)
            with _autocast(self.autocast):
                y = self.stage(x)
            if self.is_last:
                outs.append(y.float())
            else:
                self.p2p.send(y, self.next, TAG_ACT)
        self.p2p.wait_all()
        return torch.cat(outs) if self.is_last else None


# ------------------------------------------------------------------ torch.distributed.pipelining schedules
class _AutocastStage(nn.Module):
    """The stage under the job's autocast, with a contiguous output (torch receives a stage's raw memory
    into a contiguous buffer: a channels-last activation would arrive scrambled)."""

    def __init__(self, stage: nn.Module, autocast=None):
        super().__init__()
        self.stage, self.autocast = stage, autocast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _autocast(self.autocast):
            return self.stage(x).contiguous()


class _Stage(PipelineStage):
    """torch's `PipelineStage` with a float32 communicator warm-up (gloo refuses torch 2.9.1's int64 one)
    and shape inference in eval mode with the RNG restored (README.md: Schedules)."""

    def _get_init_p2p_neighbors_ops(self) -> list:
        ops = super()._get_init_p2p_neighbors_ops()
        for op in ops:
            if op.op is dist.isend:
                op.tensor = torch.zeros(1, device=self.device)
        return ops

    def _shape_inference(self, args, kwargs=None):
        devices = [self.device] if self.device.type == "cuda" else []
        was_training = self.submod.training
        self.submod.eval()
        try:
            with torch.random.fork_rng(devices=devices):
                return super()._shape_inference(args, kwargs)
        finally:
            self.submod.train(was_training)


class TorchSchedule(StagePosition):
    """torch's ``ScheduleGPipe``/``Schedule1F1B`` for one stage, with the contract of
    `GPipeSchedule.train_step`. torch fixes micro-batch shapes at a schedule's first step: one schedule per
    batch size; a batch it cannot take (`supports`) is the caller's to run on `GPipeSchedule`. ``group``:
    the pipeline's process group (stage s is its group rank s)."""

    KINDS = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}

    def __init__(
        self,
        kind: str,
        stage: nn.Module,
        stage_index: int,
        n_stages: int,
        group,
        n_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        autocast=None,
    ):
        if kind not in self.KINDS:
            raise ValueError(f"unknown torch pipeline schedule {kind!r} (gpipe or 1f1b)")
        self.kind, self.index, self.n_stages, self.group = kind, stage_index, n_stages, group
        self.m, self.loss_fn, self.device, self.autocast = n_microbatches, loss_fn, device, autocast
        self.module = _AutocastStage(stage, autocast)
        self._schedules: dict[int, Any] = {}

    def supports(self, batch_size: int) -> bool:
        return self.n_stages > 1 and self.m >= self.n_stages and batch_size % self.m == 0

    def _schedule(self, batch_size: int):
        sched = self._schedules.get(batch_size)
        if sched is None:
            stage = _Stage(self.module, self.index, self.n_stages, self.device, group=self.group)

            def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
                with _autocast(self.autocast):
                    return self.loss_fn(logits, targets) * (targets.shape[0] / batch_size)

            sched = self.KINDS[self.kind](stage, self.m, loss_fn=loss, scale_grads=False)
            self._schedules[batch_size] = sched
        return sched

    def infer_shapes(self, batch_size: int, inputs: torch.Tensor | None) -> None:
        """Fix the micro-batch shapes of batches of ``batch_size`` now (a collective over the pipeline,
        every stage calls it) instead of in the first training step: torch's shape inference sends each
        stage's output shapes to the next stage as pickled objects, host reads the step must not make.
        ``inputs``: on the first stage, a batch as the step gives it (values unused: only the shape, dtype
        and device count); None on the others."""
        if not self.supports(batch_size):
            return
        stage = self._schedule(batch_size)._stage
        if stage.inputs_meta is None:
            stage._shape_inference((inputs.tensor_split(self.m)[0],) if self.is_first else ())

    def train_step(
        self, inputs: torch.Tensor | None, targets: torch.Tensor | None, batch_size: int
    ) -> torch.Tensor | None:
        sched = self._schedule(batch_size)
        losses: list[torch.Tensor] = []
        if self.is_first:
            if inputs is None:
                raise ValueError("pipeline stage 0 needs the input batch")
            sched.step(inputs)
        elif self.is_last:
            if targets is None:
                raise ValueError(f"pipeline stage {self.index} needs the targets")
            sched.step(target=targets, losses=losses)
        else:
            sched.step()
        sched._stage.clear_runtime_states()  # drop the kept output chunks and activations until the next step
        if not self.is_last:
            return None
        return torch.stack([loss.detach().float() for loss in losses]).sum()
