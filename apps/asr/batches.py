"""ASR training batches at device speed: frames padded to a few bucket lengths (`bucket_frames`: a compiled
model meets a handful of shapes), from the tier `mariana.platform.data.shards.choose_tier` picks: ``device``
/ ``host`` (the whole fp16 cache in one tensor, batches gathered in-process: `ResidentBatches`) or ``disk``
(the memory-mapped shards through one persistent `IndexBatchLoader`). Every batch carries ``sizes``
(`HostSizes`: the lengths CTC needs on the host), so the step never reads them back from the device.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from mariana.platform.core.prefetch import Prefetcher
from mariana.platform.data.shards import choose_tier
from mariana.platform.dp.sampler import IndexBatchLoader

from .features import UtteranceSet


def bucket_frames(t: int, base: int = 32, ratio: float = 1.25, align: int = 16) -> int:
    """The padded length of a batch whose longest utterance has ``t`` frames: the smallest of base,
    base x ratio, ... (each rounded up to a multiple of ``align``) that is >= t. About 11 % padding on
    average; 15 lengths cover 1..1000 frames."""
    b = base
    while b < t:
        b = int(math.ceil(b * ratio / align) * align)
    return b


@dataclass
class HostSizes:
    """Lengths that stay on the host (CTC reads them there): ``lengths`` [B] frames, ``target_lengths``
    [B] units, both int64 CPU tensors. Not a tensor itself, so moving a batch to the device leaves it."""

    lengths: torch.Tensor
    target_lengths: torch.Tensor


def collate_bucketed(items) -> dict:
    """[(feats [T_i, F], targets [L_i])] -> feats [B, bucket_frames(max T_i), F] zero-padded, lengths [B],
    targets [sum L], target_lengths [B], sizes (`HostSizes`)."""
    t = bucket_frames(max(len(f) for f, _ in items))
    feats = torch.zeros(len(items), t, items[0][0].shape[1])
    for i, (f, _) in enumerate(items):
        feats[i, : len(f)] = f
    lengths = torch.tensor([len(f) for f, _ in items])
    target_lengths = torch.tensor([len(t) for _, t in items])
    return {
        "feats": feats,
        "lengths": lengths,
        "targets": torch.cat([t for _, t in items]),
        "target_lengths": target_lengths,
        "sizes": HostSizes(lengths, target_lengths),
    }


class ResidentBatches:
    """The `BatchLoader` of a feature cache held whole in memory (the ``device`` or ``host`` tier).

    ``store``: every utterance's fp16 frames [N + 1, F] on ``store_device`` (the last row zeros, what
    padding gathers); batches come out on ``device``: feats [B, T, F] float32 (T a bucket length),
    lengths [B], targets, target_lengths, sizes (`HostSizes`)."""

    def __init__(self, dataset: UtteranceSet, sampler, device: torch.device, store_device: torch.device):
        cache = dataset.cache
        shards = sorted({u["shard"] for u in cache.utts})
        base: dict[int, int] = {}
        parts, n = [], 0
        for k in shards:
            a = np.asarray(cache._shard(k))
            base[k], n = n, n + len(a)
            parts.append(a)
        starts = [base[u["shard"]] + u["offset"] for u in cache.utts]
        frames = torch.from_numpy(np.concatenate(parts + [np.zeros((1, cache.dim), np.float16)]))
        self.pad_row = n
        self.device, self.sampler = device, sampler
        pin = device.type == "cuda" and store_device.type == "cpu"
        self.store = frames.pin_memory() if pin else frames.to(store_device)
        # Index tables on the host as numpy: a batch's index arithmetic is a few numpy calls, not torch CPU
        # ops (each a dispatch), and its integers travel to the device in one packed copy (`assemble`).
        self.starts = np.asarray(starts, dtype=np.int64)
        self.lengths = np.asarray(cache.lengths, dtype=np.int64)
        self.targets = [self._units(dataset, i) for i in range(len(dataset))]
        self.target_lengths = np.asarray([len(t) for t in self.targets], dtype=np.int64)
        self.batches_per_epoch = sampler.batches_per_epoch
        self.nbytes = frames.numel() * frames.element_size()

    @staticmethod
    def _units(dataset: UtteranceSet, i: int) -> np.ndarray:
        return np.asarray([dataset.unit.get(w, 0) for w in dataset.cache.utts[i]["words"]], dtype=np.int64)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def assemble(self, idx: list[int]) -> dict:
        """One batch of utterances ``idx`` (see the class docstring).

        The store rows [B, T], lengths [B], targets [sum L] and target lengths [B] are packed into one int64
        host array and copied to the device at once (one pinned copy instead of four), then split there into
        views; the host keeps its own views as ``sizes``."""
        idx = np.asarray(idx, dtype=np.int64)
        lens = self.lengths[idx]
        t = bucket_frames(int(lens.max()))  # host values: no device read
        ar = np.arange(t)
        rows = np.where(ar < lens[:, None], self.starts[idx][:, None] + ar, self.pad_row)
        b, n = len(idx), rows.size
        host = torch.from_numpy(
            np.concatenate([rows.ravel(), lens, *[self.targets[i] for i in idx], self.target_lengths[idx]])
        )
        dev = self._to_device(host)
        n_tg = len(host) - n - 2 * b
        if self.store.device.type == self.device.type:
            # gather and fp16 -> fp32 where the store is (index_select: the leanest gather kernel)
            feats = self.store.index_select(0, dev[:n]).view(b, t, -1).float()
        else:
            feats = self._to_device(self.store.index_select(0, host[:n]).view(b, t, -1).float())
        lengths, tl = host[n : n + b], host[n + b + n_tg :]
        return {
            "feats": feats,
            "lengths": dev[n : n + b],
            "targets": dev[n + b : n + b + n_tg],
            "target_lengths": dev[n + b + n_tg :],
            "sizes": HostSizes(lengths, tl),
        }

    def iterate(self, epoch: int, start: int = 0) -> Iterator[dict]:
        for idx in self.sampler.batches(epoch, start):
            yield self.assemble(idx)


class PrefetchedLoader:
    """A persistent `IndexBatchLoader` whose batches are copied to a GPU one step ahead (`Prefetcher`)."""

    def __init__(self, inner: IndexBatchLoader, device: torch.device):
        self.inner, self.device = inner, device
        self.batches_per_epoch = inner.batches_per_epoch

    def iterate(self, epoch: int, start: int = 0):
        it = self.inner.iterate(epoch, start)
        return Prefetcher(it, depth=2, device=self.device) if self.device.type == "cuda" else it


def make_loader(cfg, dataset: UtteranceSet, sampler, device: torch.device):
    """The training `BatchLoader` of the tier the cache's size picks (``--cache-gb``) -> (loader, tier)."""
    nbytes = sum(dataset.cache.lengths) * dataset.cache.dim * 2
    tier = choose_tier(nbytes, device, cfg.cache_gb)
    if tier in ("device", "host"):
        store = device if tier == "device" else torch.device("cpu")
        return ResidentBatches(dataset, sampler, device, store), tier
    inner = IndexBatchLoader(
        dataset,
        sampler,
        collate_fn=collate_bucketed,
        num_workers=cfg.num_workers,
        pin_memory=device.type == "cuda",
    )
    return PrefetchedLoader(inner, device), tier
