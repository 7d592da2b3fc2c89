"""Where a job's working set (feature cache, decoded images, encoded rows) lives: one rule for every app.

``device`` when it fits in a share of the training device's free memory (a GPU; on the CPU the device is
host RAM, so the ``--cache-gb`` limit applies), then ``host`` RAM up to ``--cache-gb`` gigabytes, then
``disk`` (memory-mapped shards read by loader workers).
"""

from __future__ import annotations

import os

import torch

DEVICE_SHARE = 0.25  # of the GPU's free memory: the rest is for the model, activations and the allocator
RAM_SHARE = (
    0.25  # of physical RAM: the --cache-gb of an app that leaves it unset (the rest: model, OS, others)
)


def host_budget_gb(cache_gb: float | None) -> float:
    """``cache_gb``, or when it is None a quarter of this machine's physical RAM, in GB (1e9 bytes)."""
    if cache_gb is not None:
        return cache_gb
    return RAM_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def choose_tier(nbytes: int, device: torch.device, cache_gb: float, free_device: int | None = None) -> str:
    """``"device"``, ``"host"`` or ``"disk"`` for a working set of ``nbytes`` bytes trained on ``device``.

    ``cache_gb``: the most host RAM the set may take (0: never in RAM); ``free_device``: the GPU's free bytes
    (default: asked from CUDA)."""
    limit = int(cache_gb * 1e9)
    if device.type == "cuda":
        if free_device is None:
            free_device = torch.cuda.mem_get_info(device)[0]
        if nbytes <= DEVICE_SHARE * free_device:
            return "device"
        return "host" if nbytes <= limit else "disk"
    return "device" if nbytes <= limit else "disk"  # a CPU's device memory is its RAM
