"""pCTR's optimisers from its flags: the row rule the parameter-server framework applies to the table's
rows (`mariana.platform.ps.rowopt`: SGD, Adagrad or FTRL-Proximal, on the touched rows only, locally or on
the servers) and the torch optimiser of the dense parameters (`build_dense`)."""

from __future__ import annotations

import torch
from mariana.platform.ps.dense import build_dense_optimizer
from mariana.platform.ps.rowopt import RowOptConfig


def row_config(cfg) -> RowOptConfig:
    """The parameter-server / local-shard row rule from a `PctrConfig`."""
    return RowOptConfig(rule=cfg.sparse_optimizer, lr=cfg.sparse_lr, ftrl_l1=cfg.ftrl_l1, ftrl_l2=cfg.ftrl_l2)


def build_dense(cfg, params) -> torch.optim.Optimizer:
    """The dense parameters' optimiser (``--optimizer``, ``--lr``)."""
    return build_dense_optimizer(cfg.optimizer, list(params), cfg.lr)
