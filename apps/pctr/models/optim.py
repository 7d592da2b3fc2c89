"""pCTR's optimisers from its flags: the row rule the parameter-server framework applies to the table's
rows (`mariana.platform.sparse.rules`: SGD, Adagrad or FTRL-Proximal, on the touched rows only, locally or on
the servers) and the torch optimiser of the dense parameters (`build_dense`)."""

from __future__ import annotations

import torch
from mariana.platform.ps.dense import build_dense_optimizer
from mariana.platform.sparse.rules import RowOptConfig

from ..configs import DenseOptim, Table


def row_config(table: Table) -> RowOptConfig:
    """The parameter-server / local-shard row rule of the ``table`` section."""
    return RowOptConfig(
        rule=table.sparse_optimizer, lr=table.sparse_lr, ftrl_l1=table.ftrl_l1, ftrl_l2=table.ftrl_l2
    )


def build_dense(optim: DenseOptim, params) -> torch.optim.Optimizer:
    """The dense parameters' optimiser (``--optimizer``, ``--lr`` of the ``optim`` section)."""
    return build_dense_optimizer(optim.optimizer, list(params), optim.lr)
