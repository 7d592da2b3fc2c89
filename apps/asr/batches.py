"""ASR training batches at device speed.

Frames are padded to a few bucket lengths (`bucket_frames`), so a compiled model meets a handful of shapes.
The feature cache goes where `mariana.platform.core.tiers.choose_tier` puts it:

- ``device`` / ``host``: the whole fp16 cache in one tensor on the training device (or in host RAM, pinned
  when training on a GPU); each batch is assembled there from an index (`ResidentBatches`: index ->
  gather -> fp32; splicing happens in the model), in the training process, with no worker processes;
- ``disk``: the memory-mapped shards through one persistent `IndexBatchLoader` (built once for the whole
  run), pinned, with the copy of batch t+1 overlapping step t on a GPU (`Prefetcher`).

Every batch carries ``sizes`` (`HostSizes`): the utterance and target lengths on the host, which CTC
needs there, so the step never reads them back from the device.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from mariana.platform.core.prefetch import Prefetcher
from mariana.platform.core.tiers import choose_tier
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
        self.starts = torch.tensor(starts, dtype=torch.long)
        self.lengths = torch.tensor(cache.lengths, dtype=torch.long)
        self.targets = [self._units(dataset, i) for i in range(len(dataset))]
        self.batches_per_epoch = sampler.batches_per_epoch
        self.nbytes = frames.numel() * frames.element_size()

    @staticmethod
    def _units(dataset: UtteranceSet, i: int) -> torch.Tensor:
        return torch.tensor(
            [dataset.unit.get(w, 0) for w in dataset.cache.utts[i]["words"]], dtype=torch.long
        )

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def assemble(self, idx: list[int]) -> dict:
        """One batch of utterances ``idx`` (see the class docstring)."""
        lens = self.lengths[idx]
        t = bucket_frames(int(lens.max()))  # host values: no device read
        ar = torch.arange(t)
        rows = torch.where(ar < lens.unsqueeze(1), self.starts[idx].unsqueeze(1) + ar, self.pad_row)
        if self.store.device.type == "cuda":
            feats = self.store[self._to_device(rows)].float()  # gather and fp16 -> fp32 on the device
        else:
            feats = self._to_device(self.store[rows].float())
        tl = torch.tensor([len(self.targets[i]) for i in idx])
        return {
            "feats": feats,
            "lengths": self._to_device(lens),
            "targets": self._to_device(torch.cat([self.targets[i] for i in idx])),
            "target_lengths": self._to_device(tl),
            "sizes": HostSizes(lens, tl),
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
