"""``mariana mlp train``: the data-parallel smoke-test job, built the way every app's train.py is."""

from __future__ import annotations

import dataclasses

import torch

from ..core.export import export_model
from ..core.loop import Trainer, unwrap
from ..core.rundir import start_run
from ..dp.ddp import apply_data_parallel
from ..dp.dist import init_distributed, teardown
from ..dp.sampler import IndexBatchLoader, ShardedBatchSampler
from .configs import MlpConfig
from .data import read_libfm, split
from .evaluate import metrics
from .model import ClickMLP


def step_fn(model, batch):
    logits = model(batch["ids"], batch["mask"])
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), batch["label"])
    return loss, batch["label"].shape[0]


def train(cfg: MlpConfig) -> dict:
    ctx = init_distributed(cfg.device, cfg.timeout)
    try:
        run, log = start_run(cfg, ctx.rank, ctx.is_main)
        labels, ids, _ = read_libfm(cfg.data, cfg.limit)
        train_rows, val_rows = split(labels, ids, cfg.val_fraction, cfg.buckets, cfg.test_fraction)
        log.info(
            "%d training rows, %d validation rows, %d test rows held out, %d worker(s)",
            len(train_rows),
            len(val_rows),
            len(labels) - len(train_rows) - len(val_rows),
            ctx.world_size,
        )
        model = apply_data_parallel(
            ClickMLP(cfg.buckets, cfg.embed_dim, cfg.hidden, cfg.layers), ctx, grad_comm=cfg.grad_comm
        )
        sampler = ShardedBatchSampler(len(train_rows), cfg.batch_size, ctx.rank, ctx.world_size, cfg.seed)
        loader = IndexBatchLoader(train_rows, sampler, num_workers=cfg.num_workers)
        trainer = Trainer(
            cfg, model, None, None, loader, step_fn, ctx, run, eval_fn=lambda m: metrics(m, val_rows)
        )
        final = trainer.fit()
        if ctx.is_main:
            export_model(
                run.path,
                unwrap(model).state_dict(),
                {"app": "mlp", "job": "mlp", "config": dataclasses.asdict(cfg)},
            )
        return final
    finally:
        teardown(ctx)
