"""Optimisers for sparse embeddings: sparse Adagrad and FTRL-Proximal as ``torch.optim.Optimizer``s.

They take parameters whose ``.grad`` is a sparse COO tensor (``nn.Embedding(sparse=True)``) or dense,
coalesce it, and update only the touched rows with the same row rules the parameter servers apply
(`mariana.platform.ps.rowopt`), so a model trained in-process and on servers follows the same math.
Dense parameters use ``torch.optim.Adam`` (`build_dense`).
"""

from __future__ import annotations

import torch
from mariana.platform.ps.dense import build_dense_optimizer
from mariana.platform.ps.rowopt import RowOptConfig, apply_rows, coalesce, init_state


class _RowOptimizer(torch.optim.Optimizer):
    rule = "sgd"

    def __init__(self, params, lr: float, **kw):
        super().__init__(params, dict(lr=lr, **kw))

    def _cfg(self, group) -> RowOptConfig:
        keys = ("eps", "initial_accumulator", "ftrl_beta", "ftrl_l1", "ftrl_l2")
        return RowOptConfig(rule=self.rule, lr=group["lr"], **{k: group[k] for k in keys if k in group})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            cfg = self._cfg(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                w = p.data.view(p.shape[0], -1)
                st = self.state[p]
                if not st:
                    st.update(init_state(self.rule, w, cfg))
                if p.grad.is_sparse:
                    g = p.grad.coalesce()
                    rows, vals = coalesce(g.indices()[0], g.values().reshape(g.values().shape[0], -1))
                else:  # dense gradient: rows with any non-zero entry
                    gd = p.grad.view(p.shape[0], -1)
                    rows = gd.abs().sum(1).nonzero(as_tuple=True)[0]
                    vals = gd.index_select(0, rows)
                apply_rows(w, st, rows, vals, cfg)
        return loss


class SparseAdagrad(_RowOptimizer):
    """Adagrad on the touched rows only: ``a += g^2; w -= lr * g / (sqrt(a) + eps)``."""

    rule = "adagrad"

    def __init__(self, params, lr: float = 0.05, eps: float = 1e-8, initial_accumulator: float = 0.0):
        super().__init__(params, lr, eps=eps, initial_accumulator=initial_accumulator)


class FTRL(_RowOptimizer):
    """FTRL-Proximal (McMahan et al. 2013), per coordinate; ``l1 > 0`` makes weights exactly zero."""

    rule = "ftrl"

    def __init__(self, params, lr: float = 0.05, beta: float = 1.0, l1: float = 0.0, l2: float = 0.0):
        super().__init__(params, lr, ftrl_beta=beta, ftrl_l1=l1, ftrl_l2=l2)


def row_config(cfg) -> RowOptConfig:
    """The parameter-server / local-shard row rule from a `PctrConfig`."""
    return RowOptConfig(rule=cfg.sparse_optimizer, lr=cfg.sparse_lr, ftrl_l1=cfg.ftrl_l1, ftrl_l2=cfg.ftrl_l2)


def build_dense(cfg, params) -> torch.optim.Optimizer:
    return build_dense_optimizer(cfg.optimizer, list(params), cfg.lr)
