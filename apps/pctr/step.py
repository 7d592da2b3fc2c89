"""pCTR's click models on the parameter-server framework's steps (`mariana.platform.ps`).

The framework's `LocalStep` (one process) and `PSWorkerStep` (a worker of a parameter-server job) take a
model implementing `mariana.platform.ps.protocol.SparseModel`; `CTRModel` does. This module builds them
from a `PctrConfig`: the model (dense layers first, then the table: see `CTRModel`), the row and dense
optimisers, and with ``--ids dynamic`` the id map.
"""

from __future__ import annotations

import torch
from mariana.platform.ps.local import LocalStep
from mariana.platform.ps.shard import init_rows
from mariana.platform.ps.worker_step import PSWorkerStep

from .configs import PctrConfig
from .idmap import IdMap
from .model import CTRModel, build_model
from .optim import build_dense, row_config


def build_dense_only(cfg: PctrConfig, schema) -> CTRModel:
    """The model with a 1-row-per-field table stub, for processes whose rows live on parameter servers.
    Its dense layers start as in-process training's: they are created before the table (see CTRModel)."""
    return build_model(cfg, type(schema)(schema.format, schema.num_fields, 1, schema.num_dense))


def idmap_for(cfg: PctrConfig, schema) -> IdMap | None:
    """``--ids dynamic``'s id map (keys -> rows), None with ``--ids hash``."""
    if getattr(cfg, "ids", "hash") != "dynamic":
        return None
    return IdMap(schema.num_fields, schema.rows_per_field, cfg.admit_after, cfg.evict, cfg.sketch_width)


def make_local_step(cfg: PctrConfig, setup, device: torch.device) -> LocalStep:
    """The one-process step of ``setup`` (a `train.Setup`) on ``device``; its id map is also set as
    ``setup.idmap`` (exported with the table)."""
    model = build_model(cfg, setup.schema, table=init_rows(setup.spec, cfg.seed)).to(device)
    setup.idmap = idmap_for(cfg, setup.schema)
    # criteo's values are all 1 by construction (decided once per data set, not per batch)
    unit = setup.schema.format == "criteo" and getattr(setup, "image", None) is None
    return LocalStep(
        cfg,
        model,
        model.table.weight.data,
        setup.spec,
        row_config(cfg),
        build_dense(cfg, model.dense_parameters()),
        device,
        unit_vals=unit,
        idmap=setup.idmap,
    )


def make_worker_step(cfg: PctrConfig, schema, client, role, run) -> PSWorkerStep:
    """A parameter-server worker's step: the dense layers (seeded as one process seeds them), rows from
    the servers through ``client``."""
    torch.manual_seed(cfg.seed)
    width = 1 + (0 if cfg.model == "lr" else cfg.dim)  # the table's row width (Setup.spec)
    dynamic = getattr(cfg, "ids", "hash") == "dynamic"
    return PSWorkerStep(cfg, build_dense_only(cfg, schema), width, client, role, run, dynamic)
