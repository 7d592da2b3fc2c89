"""Deterministic sharded batching.

`ShardedBatchSampler` draws one permutation per epoch from ``(seed, epoch)`` and cuts it into *global*
batches of ``batch_size x world_size`` samples; rank r takes the r-th contiguous slice of each. So N ranks
with per-rank batch B see exactly the samples one process with batch N*B sees, in the same steps (the
data-parallel equivalence the tests check), and a position ``(epoch, batch)`` is all a checkpoint needs to
resume the data stream exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ..core.errors import MarianaError


class ShardedBatchSampler:
    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if num_samples < 1:
            raise MarianaError("the training data set is empty (0 samples)")
        self.n, self.batch_size, self.rank, self.world = num_samples, batch_size, rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        g = batch_size * world_size
        self.batches_per_epoch = num_samples // g if drop_last else math.ceil(num_samples / g)
        if self.batches_per_epoch == 0:
            raise MarianaError(
                f"one epoch has 0 batches: {num_samples} training samples is less than one global batch "
                f"(--batch-size {batch_size} x {world_size} worker(s)); use a smaller --batch-size or fewer "
                "--workers"
            )

    def permutation(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=g)

    def batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        """This rank's index lists for global batches ``start..`` of ``epoch``."""
        perm = self.permutation(epoch)
        g = self.batch_size * self.world
        if not self.drop_last and self.n % g:  # pad the last global batch by wrapping around
            perm = torch.cat([perm, perm[: g - self.n % g]])
        lo = self.rank * self.batch_size
        for b in range(start, self.batches_per_epoch):
            yield perm[b * g + lo : b * g + lo + self.batch_size].tolist()

    def __len__(self) -> int:
        return self.batches_per_epoch


class IndexBatchLoader:
    """The training loop's `BatchLoader` over a map-style dataset and a `ShardedBatchSampler`.

    ``collate_fn=None`` with a dataset that implements ``__getitems__`` returning a ready batch skips
    per-sample Python work (the fast path); otherwise torch's default collate is used. One `DataLoader` is
    built for the whole run: its worker processes persist over epochs, and each
    ``iterate`` only hands it that epoch's index lists."""

    def __init__(
        self,
        dataset: Dataset,
        sampler: ShardedBatchSampler,
        collate_fn: Callable[[Any], Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        self.dataset, self.sampler = dataset, sampler
        self.collate_fn, self.num_workers, self.pin_memory = collate_fn, num_workers, pin_memory
        self.batches_per_epoch = sampler.batches_per_epoch
        self.epoch_batches = _EpochBatches()
        self.loader: DataLoader | None = None

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Any]:
        self.epoch_batches.lists = list(self.sampler.batches(epoch, start))
        if self.loader is None:
            collate = self.collate_fn
            if collate is None and hasattr(self.dataset, "__getitems__"):
                collate = _identity
            self.loader = DataLoader(
                self.dataset,
                batch_sampler=self.epoch_batches,
                collate_fn=collate,
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
                prefetch_factor=4 if self.num_workers else None,
                persistent_workers=self.num_workers > 0,
            )
        return iter(self.loader)


class _EpochBatches:
    """The one DataLoader's batch sampler: the index lists of the epoch being iterated."""

    def __init__(self):
        self.lists: list[list[int]] = []

    def __iter__(self):
        return iter(self.lists)

    def __len__(self) -> int:
        return len(self.lists)


def _identity(x):
    return x
