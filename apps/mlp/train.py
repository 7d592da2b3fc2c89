"""``mariana mlp train``: the data-parallel smoke-test job, built the way every app's train.py is."""

from __future__ import annotations

import dataclasses

import torch
from mariana.platform.core.evaluator import evaluator_from
from mariana.platform.core.export import export_model
from mariana.platform.core.loop import Trainer
from mariana.platform.core.rundir import start_run
from mariana.platform.core.steps import ModuleStep, unwrap
from mariana.platform.core.warmstart import warm_start
from mariana.platform.dp.ddp import apply_data_parallel
from mariana.platform.dp.sampler import IndexBatchLoader, ShardedBatchSampler
from mariana.platform.runtime.dist import init_distributed, teardown

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
        net = ClickMLP(cfg.buckets, cfg.embed_dim, cfg.hidden, cfg.layers)
        if cfg.init_from:
            warm_start(net, cfg.init_from, "mlp")
        model = apply_data_parallel(net, ctx, grad_comm=cfg.grad_comm)
        sampler = ShardedBatchSampler(len(train_rows), cfg.batch_size, ctx.rank, ctx.world_size, cfg.seed)
        loader = IndexBatchLoader(train_rows, sampler, num_workers=cfg.num_workers)

        def export(eval_metrics: dict, step: int) -> None:
            if ctx.is_main:
                export_model(
                    run.path,
                    unwrap(model).state_dict(),
                    app="mlp",
                    arch="click-mlp",
                    config=dataclasses.asdict(cfg),
                    metrics=eval_metrics,
                )

        trainer = Trainer(
            cfg,
            ModuleStep(cfg, model, step_fn, ctx),
            loader,
            ctx,
            run,
            evaluator=evaluator_from(cfg, lambda m: metrics(m, val_rows), "auc"),
            exporter=export,
        )
        final = trainer.fit()
        return final
    finally:
        teardown(ctx)
