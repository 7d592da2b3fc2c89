"""Pipeline model parallelism of ``mariana vision train --model-parallel K`` (K > 1): the net's blocks cut
into K stages over a (pipeline x data parallel) mesh (`mariana.platform.pipeline`), and the stages' loader."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from mariana.platform.dp.sampler import ShardedBatchSampler
from mariana.platform.pipeline import parallelize_pipeline
from mariana.platform.runtime.dist import ParallelDims

from .data import DecodedImages
from .model import as_blocks

if TYPE_CHECKING:
    from .configs import VisionPipeline

log = logging.getLogger("mariana")


class PipelineLoader:
    """Pipeline batches from a cached set: stage 0 gets images, the last stage labels, all the size. The
    global batches of the data-parallel group ``pp`` (a `PipelineParallel`) belongs to."""

    def __init__(self, data: DecodedImages, pp, batch_size: int, seed: int):
        self.data, self.first, self.last = data, pp.is_first, pp.is_last
        self.sampler = ShardedBatchSampler(len(data), batch_size, pp.dp_index, pp.dp_size, seed)
        self.batches_per_epoch = self.sampler.batches_per_epoch

    def iterate(self, epoch: int, start: int = 0):
        for idx in self.sampler.batches(epoch, start):
            t = torch.as_tensor(idx, device=self.data.images.device)
            yield (
                self.data.images[t] if self.first else None,
                self.data.labels[t] if self.last else None,
                len(idx),
            )


def build_pipeline(
    model, pipe: VisionPipeline, ctx, loss_fn, sample: Callable, grad_comm: str, autocast: Callable
):
    """``model``'s blocks split into ``pipe.model_parallel`` stages over a (pipeline x data parallel) mesh,
    balanced by ``pipe.stage_balance`` (params, time measured on the micro-batch ``sample()``, or explicit
    block indices) -> the `PipelineParallel` of this rank."""
    k = pipe.model_parallel
    mesh = ParallelDims(world_size=ctx.world_size, mp=k).build_mesh(ctx.device.type)
    balance: Any = pipe.stage_balance
    example = None
    if balance == "time":
        example = sample()
    elif balance != "params":
        balance = [int(b) for b in balance.split(",")]
    blocks, mb = as_blocks(model), pipe.micro_batches
    pp = parallelize_pipeline(
        blocks, mesh, ctx.device, loss_fn, mb, balance, example, grad_comm, autocast, pipe.pipeline_schedule
    )
    n = sum(p.numel() for p in pp.stage.parameters())
    what = (pp.stage_index, k, list(pp.stage._modules), n, pp.dp_ranks)
    log.info("pipeline: stage %d/%d blocks %s (%d params), gradient group ranks %s", *what)
    return pp
