"""The row-update rules of embedding tables: one definition each, applied to unique rows or to padded slots.

A push is ``(rows [U] unique row indices, grad [U, K])``; only those rows of the weight ``[R, K]`` and of
the rule's state change, in place, in O(U x K) memory. Each rule is written once, in `new_rows`, on the
rows gathered from the table; `apply_rows` writes them back for unique rows (the eager steps and the
servers' pushes), `apply_slots` for the fixed-shape step's padded slots. The C loop (`kernels.update_rows`,
float32 CPU tables) implements sgd and adagrad with the same operations per element.

- ``sgd``:      w -= lr * g
- ``adagrad``:  a += g^2;  w -= lr * g / (sqrt(a) + eps)            (Duchi et al. 2011, per coordinate)
- ``ftrl``:     FTRL-Proximal (McMahan et al. 2013) with z, n state; l1 > 0 gives exact zeros.

Large CPU tables (weights and rule state, `table_empty`, `table_full_like`) live on transparent huge pages
(Linux): with 4 KiB pages nearly every random row access misses the TLB (`bench/pctr_throughput.py`). The
kernel backs a region with huge pages only if asked before its pages are first touched, so tables are
allocated here and filled afterwards; elsewhere (other OSes, THP disabled, CUDA) plain ``torch.empty``.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from dataclasses import dataclass

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


RULES = ("sgd", "adagrad", "ftrl")
STATE = {"sgd": (), "adagrad": ("acc",), "ftrl": ("z", "n")}  # the rule's state tensors, each [R, K]


@dataclass
class RowOptConfig:
    rule: str = "adagrad"
    lr: float = 0.05
    eps: float = 1e-8
    initial_accumulator: float = 0.0
    ftrl_beta: float = 1.0
    ftrl_l1: float = 0.0
    ftrl_l2: float = 0.0


def init_state(rule: str, weight: torch.Tensor, cfg: RowOptConfig) -> dict[str, torch.Tensor]:
    """Optimiser state tensors for a ``[N, K]`` weight (same device/dtype)."""
    if rule not in STATE:
        raise ValueError(f"unknown row optimiser {rule!r}; choose from {', '.join(RULES)}")
    start = {"acc": cfg.initial_accumulator, "z": 0.0, "n": 0.0}
    return {k: table_full_like(weight, start[k]) for k in STATE[rule]}


def _minus_lr(w: torch.Tensor, step: torch.Tensor, lr) -> torch.Tensor:
    """``w - lr * step`` in place in ``w``: with a float ``lr`` one fused multiply-add (``sub_``'s alpha, as
    the C loop's ``fmaf``); with a 0-d tensor (the compiled step's, so that a changing rate is data, not a
    constant the graph is specialised on) the product, then the difference: the two may differ in the last
    bit."""
    if isinstance(lr, torch.Tensor):
        return w.sub_(step * lr)
    return w.sub_(step, alpha=lr)


def new_rows(cfg: RowOptConfig, w: torch.Tensor, state: dict[str, torch.Tensor], g: torch.Tensor, lr):
    """THE rule: rows ``w`` [U, K] and their state rows (gathered copies: changed in place), gradient ``g``
    [U, K] in the weight's dtype, learning rate ``lr`` (float or 0-d tensor) -> (new rows, new state rows)."""
    if cfg.rule == "sgd":
        return _minus_lr(w, g, lr), {}
    if cfg.rule == "adagrad":
        a = state["acc"].addcmul_(g, g)
        return _minus_lr(w, g / (a.sqrt() + cfg.eps), lr), {"acc": a}
    if cfg.rule == "ftrl":
        n = state["n"]
        n_new = n + g * g
        z = state["z"] + g - (n_new.sqrt() - n.sqrt()) / lr * w
        denom = (cfg.ftrl_beta + n_new.sqrt()) / lr + cfg.ftrl_l2
        w_new = -(z - torch.sign(z) * cfg.ftrl_l1) / denom
        return torch.where(z.abs() <= cfg.ftrl_l1, torch.zeros_like(w_new), w_new), {"z": z, "n": n_new}
    raise ValueError(f"unknown row optimiser {cfg.rule!r}")


@torch.no_grad()
def apply_rows(
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    rows: torch.Tensor,
    grad: torch.Tensor,
    cfg: RowOptConfig,
    scale: float = 1.0,
    lr: torch.Tensor | None = None,
) -> None:
    """Apply one sparse update in place. ``rows`` must be unique (callers coalesce first); ``scale``
    multiplies ``grad`` first; ``lr``: a 0-d tensor on the weight's device used instead of ``cfg.lr`` (see
    `_minus_lr`). Read-modify-write with index_select/index_copy_ rather than index_add_: on the CPU
    index_add_ into a large table is a slower per-row loop; rows are unique, so the two are equivalent."""
    if rows.numel() == 0:
        return
    g = grad.to(weight.dtype)
    if scale != 1.0:
        g = g * scale
    old = {k: state[k].index_select(0, rows) for k in STATE[cfg.rule]}
    w, new = new_rows(cfg, weight.index_select(0, rows), old, g, cfg.lr if lr is None else lr)
    for k, v in new.items():
        state[k].index_copy_(0, rows, v)
    weight.index_copy_(0, rows, w)


@torch.no_grad()
def apply_slots(
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    rows: torch.Tensor,
    grad: torch.Tensor,
    valid: torch.Tensor,
    cfg: RowOptConfig,
    lr: torch.Tensor | None = None,
) -> None:
    """`apply_rows` over fixed-shape slots: ``rows`` [N] holds each distinct row once where ``valid`` [N]
    (bool) is true; the other slots (padding, ``grad`` 0 there) may repeat rows. Every write is an
    ``index_add_`` of the change ``new - old``, masked to exactly 0 on a padding slot, so the result does not
    depend on the order in which slots read and write a repeated row: a compiler may fuse each read into the
    write (inductor does: a read-modify-write ``index_copy_`` with repeated rows then updates a row more than
    once). ``lr``: as in `apply_rows`. Equals `apply_rows` on the valid slots within rounding (``w + (new -
    w)`` for ``new``)."""
    g = grad.to(weight.dtype)
    keep = valid.unsqueeze(1)
    w = weight.index_select(0, rows)
    old = {k: state[k].index_select(0, rows) for k in STATE[cfg.rule]}
    w_new, new = new_rows(
        cfg, w.clone(), {k: v.clone() for k, v in old.items()}, g, cfg.lr if lr is None else lr
    )
    weight.index_add_(0, rows, torch.where(keep, w_new - w, 0.0))
    # the state last: written before the weight, inductor copies the whole accumulator every step (the read
    # behind the weight's update is consumed after the write); in this order it updates it in place
    for k, v in new.items():
        state[k].index_add_(0, rows, torch.where(keep, v - old[k], 0.0))


def sum_rows(grad: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``out [num_rows, K]`` with ``out[r] = sum of grad[i] over i with index[i] == r``, added in the order
    of ``i`` (zeros for rows no index names). ``grad`` [N, K], ``index`` [N] int64 in ``[0, num_rows)``.

    One ``index_add_``. (The embedding backward's CPU kernel gives the same bits but is slower on the CPU:
    `platform/README.md`, "Measured choices".)"""
    return grad.new_zeros(num_rows, grad.shape[1]).index_add_(0, index, grad)


def coalesce(rows: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the gradients of repeated rows: ``(unique rows [U], summed grad [U, K])``."""
    uniq, inv = torch.unique(rows, return_inverse=True)
    return uniq, sum_rows(grad, inv, uniq.numel())
