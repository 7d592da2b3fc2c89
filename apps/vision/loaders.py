"""The training input of ``mariana vision train``, the `BatchLoader` the platform's `Trainer` reads: the set
decoded once onto the training device when it fits in ``--cache-gb`` (`load_decoded`, `CachedLoader`), else
DataLoader workers decoding into pinned memory, prefetched ahead (`StreamLoader`). Augmentation runs on the
device (`data.make_prepare`; the fast recipe's in `fast_recipe.DeviceEpochLoader`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from mariana.platform.cli.console import warn_skipped
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.prefetch import Prefetcher
from mariana.platform.dp.sampler import IndexBatchLoader, ShardedBatchSampler

from .data import StreamingImages, collate_stream, decode_all, gpu_decode_batch, open_source, subset_indices
from .fast_recipe import DeviceEpochLoader
from .stages import PipelineLoader

if TYPE_CHECKING:
    from .configs import VisionData, VisionEval, VisionNet, VisionPipeline
    from .data import DecodedImages, ImageSource

log = logging.getLogger("mariana")


# ------------------------------------------------------------------------------------------------ decoding
def decode_device(decode: str, device: torch.device) -> torch.device:
    """Where ``--decode`` (auto, cpu, cuda) decodes JPEGs when training on ``device``."""
    if decode == "cuda" or (decode == "auto" and device.type == "cuda"):
        if not torch.cuda.is_available():
            raise MarianaError("--decode cuda needs a CUDA device")
        return device if device.type == "cuda" else torch.device("cuda")
    return torch.device("cpu")


def report_skipped(bad: list[tuple[str, str]], where: str) -> None:
    """The shared skipped-input warning for ``bad`` [(path, reason)] of ``where`` (the data set)."""
    warn_skipped(where, len(bad), bad, "corrupt image", log=log)


def load_decoded(
    src: ImageSource, where: str, size: int, decode: str, workers: int, device, limit: int, progress=False
) -> DecodedImages:
    """``src`` (the data set ``where``; its ``--limit``-style subset of ``limit`` images, 0 = all) decoded
    once at ``size`` px onto ``device``, where ``decode`` (--decode) says; on the CPU in ``workers``
    (--num-workers) processes (chunks decoded in parallel, the same pixels as one process), with nvJPEG
    batched in this process. The corrupt images are reported and listed in ``.bad``."""
    at = decode_device(decode, device)
    data = decode_all(src, size, at, limit, progress=progress, workers=workers if at.type == "cpu" else 0)
    report_skipped(data.bad, where)
    data.images, data.labels = data.images.to(device), data.labels.to(device)
    return data


def use_cache(inp: VisionData, net: VisionNet, model_parallel: int, n_images: int) -> bool:
    """Whether the decoded training set of ``n_images`` is kept in memory (--cache, --cache-gb);
    `MarianaError` where the recipe needs it (--augment alt-flip-translate, --model-parallel K > 1) and it
    does not fit."""
    est_gb = n_images * 3 * net.image_size**2 / 1e9
    cached = inp.cache == "on" or (inp.cache == "auto" and est_gb <= inp.cache_gb)
    if net.augment == "alt-flip-translate" and not cached:
        raise MarianaError(
            f"--augment alt-flip-translate needs the decoded set in memory; it needs {est_gb:.1f} GB "
            f"(> --cache-gb {inp.cache_gb}); raise --cache-gb or use --cache on"
        )
    if model_parallel > 1 and not cached:
        raise MarianaError(
            f"--model-parallel {model_parallel} reads from the decoded-image cache; the data needs "
            f"{est_gb:.1f} GB (> --cache-gb {inp.cache_gb}); raise --cache-gb or use --cache on"
        )
    return cached


@dataclass
class Images:
    """A run's images: the training set ``src`` (read from ``where``, --data), whether it is decoded once
    into memory (``cached``; else streamed), ``decoding`` (size px, --decode, --num-workers, device), its
    --limit and the held-out set (--eval-data, --eval-limit). Decoded on first use (`train`, `heldout`):
    after the model is built and checked, so a model that cannot take the image size fails before minutes
    of decoding. ``skipped``: the corrupt training images, (path, reason) once each."""

    src: ImageSource
    where: str
    cached: bool
    decoding: tuple
    limit: int
    heldout_at: tuple[str, int]
    progress: bool = False
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @cached_property
    def train(self) -> DecodedImages | None:
        if not self.cached:
            return None
        data = load_decoded(self.src, self.where, *self.decoding, self.limit, progress=self.progress)
        self.skipped.extend(data.bad)
        return data

    @cached_property
    def heldout(self) -> DecodedImages | None:
        path, limit = self.heldout_at
        return (
            load_decoded(open_source(path, self.src.classes), path, *self.decoding, limit) if path else None
        )

    @cached_property
    def n_train(self) -> int:
        return len(self.train) if self.cached else len(subset_indices(len(self.src), self.limit))


def images(input: VisionData, heldout: VisionEval, net: VisionNet, pipeline: VisionPipeline, dp, run, ctx):
    """The run's `Images` (nothing decoded yet); TF32 and cuDNN autotuning on a GPU."""
    if ctx.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    src = open_source(input.data)
    cached = use_cache(input, net, pipeline.model_parallel, len(src))
    decoding = (net.image_size, input.decode, dp.num_workers, ctx.device)
    held = (heldout.eval_data, heldout.eval_limit)
    return Images(src, input.data, cached, decoding, input.limit, held, ctx.is_main and run.progress)


# ------------------------------------------------------------------------------------------------ loaders
class CachedLoader:
    """`BatchLoader` over a `DecodedImages` (already on the training device): (uint8 [B,3,S,S], int64 [B])."""

    def __init__(self, data: DecodedImages, sampler: ShardedBatchSampler):
        self.data, self.sampler = data, sampler
        self.batches_per_epoch = sampler.batches_per_epoch

    def iterate(self, epoch: int, start: int = 0):
        for idx in self.sampler.batches(epoch, start):
            t = torch.as_tensor(idx, device=self.data.images.device)
            yield self.data.images[t], self.data.labels[t]


class StreamLoader:
    """`BatchLoader` that reads + decodes in DataLoader workers (pinned memory) and prefetches to the
    device: (uint8 [B',3,S,S], int64 [B'], skipped paths); with GPU decoding the workers only read bytes."""

    def __init__(
        self, ds: StreamingImages, sampler, num_workers: int, device, indices: list[int] | None = None
    ):
        # ``indices``: the --limit subset; the sampler then draws positions 0..len(indices)-1 within it
        subset = torch.utils.data.Subset(ds, indices) if indices is not None else ds
        self.inner = IndexBatchLoader(
            subset, sampler, collate_stream, num_workers, pin_memory=device.type == "cuda"
        )
        self.device = device
        self.batches_per_epoch = sampler.batches_per_epoch
        # raw bytes (GPU decoding): decode in the prefetch thread so that it overlaps the training step
        self.transform = None if ds.decode else gpu_decode_batch(ds.size, device)

    def iterate(self, epoch: int, start: int = 0):
        it = self.inner.iterate(epoch, start)
        return iter(Prefetcher(it, depth=3, device=self.device, transform=self.transform))


def training_loader(data: Images, model, input: VisionData, net: VisionNet, pipeline, optim, run, dp, ctx):
    """This rank's `BatchLoader`: the stages' `PipelineLoader` (K > 1; ``model`` is this rank's stage), the
    fast recipe's `DeviceEpochLoader` (--augment alt-flip-translate), a `CachedLoader` over the decoded set,
    or a `StreamLoader` over the --limit subset of the training images."""
    size, seed, rank, world = optim.batch_size, run.seed, ctx.rank, ctx.world_size
    if pipeline.model_parallel > 1:
        return PipelineLoader(data.train, model, size, seed)
    if net.augment == "alt-flip-translate":
        return DeviceEpochLoader(data.train, size, rank, world, seed)
    if data.cached:
        return CachedLoader(data.train, ShardedBatchSampler(len(data.train), size, rank, world, seed))
    on_gpu_decode = decode_device(input.decode, ctx.device).type == "cuda"
    ds = StreamingImages(data.src, net.image_size, decode=not on_gpu_decode)
    idx = subset_indices(len(data.src), data.limit)
    sampler = ShardedBatchSampler(len(idx), size, rank, world, seed)
    return StreamLoader(ds, sampler, dp.num_workers, ctx.device, idx)
