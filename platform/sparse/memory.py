"""Large CPU tables on transparent huge pages (Linux), for fast random row access.

An embedding table of tens of millions of rows is read and written at ~20k random rows per step. With
4 KiB pages nearly every row access misses the TLB; 2 MiB pages make the same ``index_select`` /
``index_copy_`` faster (`bench/pctr_throughput.py` measures the end result). The kernel backs a
region with huge pages only if asked before its pages are first touched, so tables are allocated here and
filled afterwards. Elsewhere (other OSes, THP disabled, CUDA) these are plain ``torch.empty`` calls.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

_MADV_HUGEPAGE = 14
_HUGE = 1 << 21
_MIN_BYTES = 64 << 20  # below this the TLB is not the bottleneck


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc on Linux; None elsewhere or when it cannot be loaded (callers then do nothing)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def _advise(t: torch.Tensor) -> bool:
    libc = _libc()
    addr, n = t.data_ptr(), t.numel() * t.element_size()
    start = (addr + _HUGE - 1) & ~(_HUGE - 1)
    end = (addr + n) & ~(_HUGE - 1)
    if libc is None or end <= start:
        return False
    try:
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0
    except AttributeError:  # no madvise: plain pages
        return False


def table_empty(shape: tuple[int, ...], dtype=torch.float32, device="cpu") -> torch.Tensor:
    """``torch.empty(shape)``; on CPU, large tables are advised onto huge pages before first touch."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.device.type == "cpu" and t.numel() * t.element_size() >= _MIN_BYTES:
        _advise(t)
    return t


def table_full_like(t: torch.Tensor, value: float) -> torch.Tensor:
    return table_empty(tuple(t.shape), t.dtype, t.device).fill_(value)


def keep_freed_memory() -> bool:
    """Ask glibc malloc to reuse freed blocks of up to 32 MiB instead of returning them to the kernel.

    A training step allocates and frees the same few-MB activations every time; with glibc's defaults
    many of them are fresh ``mmap``s whose pages fault in again on first touch, step after step.
    Process-wide and harmless elsewhere; returns whether the settings took."""
    libc = _libc()
    if libc is None:
        return False
    try:
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 32 << 20) == 1
        return ok and libc.mallopt(m_trim_threshold, 1 << 30) == 1
    except AttributeError:
        return False
