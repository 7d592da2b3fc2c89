"""Row-wise optimiser rules for sharded embedding tables (the update a parameter server applies to a push).

A push is ``(rows: LongTensor [U] unique local row indices, grad: FloatTensor [U, K])``; only those rows of
the weight ``[N, K]`` and of the optimiser state change. All rules are in place and touch O(U x K) memory.

- ``sgd``:      w -= lr * g
- ``adagrad``:  a += g^2;  w -= lr * g / (sqrt(a) + eps)            (Duchi et al. 2011, per coordinate)
- ``ftrl``:     FTRL-Proximal (McMahan et al. 2013) with z, n state; l1 > 0 gives exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .memory import table_full_like

RULES = ("sgd", "adagrad", "ftrl")


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
    if rule == "sgd":
        return {}
    if rule == "adagrad":
        return {"acc": table_full_like(weight, cfg.initial_accumulator)}
    if rule == "ftrl":
        return {"z": table_full_like(weight, 0.0), "n": table_full_like(weight, 0.0)}
    raise ValueError(f"unknown row optimiser {rule!r}; choose from {', '.join(RULES)}")


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
    """Apply one sparse update in place. ``rows`` must be unique (callers coalesce first).

    ``lr``: a 0-d tensor (on the weight's device) used instead of ``cfg.lr``: the compiled step's, so
    that a changing learning rate is data, not a constant a compiled graph would be specialised on (and
    recompiled for). It multiplies the step (``w - lr * step``) where the float is ``sub_``'s ``alpha``
    (one fused multiply-add): the two may differ in the last bit."""
    if rows.numel() == 0:
        return
    g = grad.to(weight.dtype)
    if scale != 1.0:
        g = g * scale
    if lr is not None:
        _apply_rows_lr_tensor(weight, state, rows, g, cfg, lr)
        return
    # Read-modify-write with index_select/index_copy_ rather than index_add_: on CPU index_add_ into a
    # large table is a slower per-row loop; rows are unique, so the two are equivalent.
    if cfg.rule == "sgd":
        weight.index_copy_(0, rows, weight.index_select(0, rows).sub_(g, alpha=cfg.lr))
    elif cfg.rule == "adagrad":
        acc = state["acc"]
        a = acc.index_select(0, rows).addcmul_(g, g)
        acc.index_copy_(0, rows, a)
        step = g.div_(a.sqrt_().add_(cfg.eps)) if g is not grad else g / a.sqrt_().add_(cfg.eps)
        weight.index_copy_(0, rows, weight.index_select(0, rows).sub_(step, alpha=cfg.lr))
    elif cfg.rule == "ftrl":
        _ftrl(weight, state, rows, g, cfg, cfg.lr)
    else:
        raise ValueError(f"unknown row optimiser {cfg.rule!r}")


def _ftrl(weight, state, rows, g, cfg: RowOptConfig, lr) -> None:
    """FTRL-Proximal on ``rows`` (``lr`` a float or a 0-d tensor: it only divides, the same either way)."""
    z_all, n_all = state["z"], state["n"]
    w = weight.index_select(0, rows)
    n = n_all.index_select(0, rows)
    n_new = n + g * g
    sigma = (n_new.sqrt() - n.sqrt()) / lr
    z = z_all.index_select(0, rows) + g - sigma * w
    denom = (cfg.ftrl_beta + n_new.sqrt()) / lr + cfg.ftrl_l2
    w_new = -(z - torch.sign(z) * cfg.ftrl_l1) / denom
    w_new = torch.where(z.abs() <= cfg.ftrl_l1, torch.zeros_like(w_new), w_new)
    z_all.index_copy_(0, rows, z)
    n_all.index_copy_(0, rows, n_new)
    weight.index_copy_(0, rows, w_new)


def _apply_rows_lr_tensor(weight, state, rows, g, cfg: RowOptConfig, lr: torch.Tensor) -> None:
    """`apply_rows` with the learning rate a 0-d tensor ``lr`` (``g`` [U, K] in the weight's dtype)."""
    if cfg.rule == "sgd":
        weight.index_copy_(0, rows, weight.index_select(0, rows) - g * lr)
    elif cfg.rule == "adagrad":
        a = state["acc"].index_select(0, rows).addcmul_(g, g)
        state["acc"].index_copy_(0, rows, a)
        weight.index_copy_(0, rows, weight.index_select(0, rows) - g / a.sqrt_().add_(cfg.eps) * lr)
    elif cfg.rule == "ftrl":
        _ftrl(weight, state, rows, g, cfg, lr)
    else:
        raise ValueError(f"unknown row optimiser {cfg.rule!r}")


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
    ``index_add_`` of a change that is exactly 0 on a padding slot, so the result does not depend on the
    order in which slots read and write a repeated row: a compiler may fuse each read into the write (inductor
    does: a read-modify-write ``index_copy_`` with repeated rows then updates a row more than once).
    ``lr``: as in `apply_rows`. Equals `apply_rows` on the valid slots within rounding (``w + (new - w)``
    for ``new``)."""
    g = grad.to(weight.dtype)
    lr = cfg.lr if lr is None else lr
    if cfg.rule == "sgd":
        weight.index_add_(0, rows, g * -lr)
    elif cfg.rule == "adagrad":
        acc = state["acc"]
        a = acc.index_select(0, rows) + g * g
        weight.index_add_(0, rows, g / (a.sqrt() + cfg.eps) * -lr)
        # acc last: with its update before the weight's, inductor copies the whole accumulator every step
        # (the read behind ``a`` is consumed after the write); in this order it updates it in place
        acc.index_add_(0, rows, g * g)
    elif cfg.rule == "ftrl":
        z_all, n_all = state["z"], state["n"]
        w, n, z = (t.index_select(0, rows) for t in (weight, n_all, z_all))
        n_new = n + g * g
        z_new = z + g - (n_new.sqrt() - n.sqrt()) / lr * w
        denom = (cfg.ftrl_beta + n_new.sqrt()) / lr + cfg.ftrl_l2
        w_new = -(z_new - torch.sign(z_new) * cfg.ftrl_l1) / denom
        w_new = torch.where(z_new.abs() <= cfg.ftrl_l1, torch.zeros_like(w_new), w_new)
        keep = valid.unsqueeze(1)  # a padding slot's closed-form w_new is not its row's weight
        z_all.index_add_(0, rows, torch.where(keep, z_new - z, 0.0))
        n_all.index_add_(0, rows, g * g)
        weight.index_add_(0, rows, torch.where(keep, w_new - w, 0.0))
    else:
        raise ValueError(f"unknown row optimiser {cfg.rule!r}")


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
