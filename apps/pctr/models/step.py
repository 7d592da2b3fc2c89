"""pCTR's click models on the parameter-server framework's steps (`mariana.platform.ps`).

The platform's `LocalStep` (one process, `mariana.platform.sparse`) and `PSWorkerStep` (a worker of a parameter-server job) take a
model implementing `mariana.platform.ps.protocol.SparseModel`; `CTRModel` does. This module builds them
from the config's sections: the model (``net``; dense layers first, then the table: see `CTRModel`), the
row and dense optimisers (``table``, ``optim``), and with ``--ids dynamic`` the id map (``rows``).
"""

from __future__ import annotations

import torch
from mariana.platform.ps.shard import init_rows
from mariana.platform.ps.worker_step import PSWorkerStep
from mariana.platform.sparse.local import LocalStep

from ..configs import Ids, Net, PctrConfig
from ..ids.idmap import IdMap
from .nets import CTRModel, build_model
from .optim import build_dense, row_config


def build_dense_only(net: Net, schema, init_std: float) -> CTRModel:
    """The model with a 1-row-per-field table stub, for processes whose rows live on parameter servers.
    Its dense layers start as in-process training's: they are created before the table (see CTRModel)."""
    stub = type(schema)(schema.format, schema.num_fields, 1, schema.num_dense)
    return build_model(net, stub, init_std=init_std)


def idmap_for(rows: Ids, schema) -> IdMap | None:
    """``--ids dynamic``'s id map (keys -> rows) of the ``rows`` section, None with ``--ids hash``."""
    if rows.ids != "dynamic":
        return None
    return IdMap(schema.num_fields, schema.rows_per_field, rows.admit_after, rows.evict, rows.sketch_width)


def make_local_step(cfg: PctrConfig, setup, device: torch.device) -> LocalStep:
    """The one-process step of ``setup`` (a `train.Setup`) on ``device``; its id map is also set as
    ``setup.idmap`` (exported with the table). ``cfg``: the run's config (`PctrConfig` or a stream's), whose
    fields across sections the platform's step reads (`mariana.platform.ps.protocol.StepConfig`)."""
    model = build_model(cfg.net, setup.schema, table=init_rows(setup.spec, cfg.seed)).to(device)
    setup.idmap = idmap_for(cfg.rows, setup.schema)
    # criteo's values are all 1 by construction (decided once per data set, not per batch)
    unit = setup.schema.format == "criteo" and getattr(setup, "image", None) is None
    dense_opt = build_dense(cfg.optim, model.dense_parameters())
    weight, rule = model.table.weight.data, row_config(cfg.table)
    return LocalStep(cfg, model, weight, rule, dense_opt, device, unit_vals=unit, idmap=setup.idmap)


def make_worker_step(cfg: PctrConfig, schema, client, role, run) -> PSWorkerStep:
    """A parameter-server worker's step: the dense layers (seeded as one process seeds them), rows from
    the servers through ``client``; ``cfg`` as for `make_local_step`."""
    torch.manual_seed(cfg.seed)
    net = cfg.net
    width = 1 + (0 if net.model == "lr" else net.dim)  # the table's row width (Setup.spec)
    dense = build_dense_only(net, schema, cfg.init_std)
    return PSWorkerStep(cfg, dense, width, client, role, run, cfg.ids == "dynamic")
