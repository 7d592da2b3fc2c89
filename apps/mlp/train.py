"""``mariana mlp train``: the data-parallel smoke-test job, declared as every app's training is (`SPEC`, a
`TrainSpec`: the platform builds and runs its Trainer). Each builder takes the config sections it reads."""

from __future__ import annotations

import logging

import torch
from mariana.platform.core.config import DataParallelSection, OptimSection, RunSection
from mariana.platform.dp.sampler import IndexBatchLoader, ShardedBatchSampler
from mariana.platform.runtime.dist import DistContext
from mariana.platform.train.spec import TrainSpec, data_parallel, train_job

from .configs import MlpConfig, MlpData, MlpModel
from .data import read_libfm, split
from .evaluate import metrics
from .model import ClickMLP


def step_fn(model, batch):
    logits = model(batch["ids"], batch["mask"])
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), batch["label"])
    return loss, batch["label"].shape[0]


def read_rows(input: MlpData, net: MlpModel, ctx: DistContext, log: logging.Logger):
    """-> (train rows, validation rows) of ``--data`` (`split`: by row order, the test rows left out)."""
    labels, ids, _ = read_libfm(input.data, input.limit)
    train_rows, val_rows = split(labels, ids, input.val_fraction, net.buckets, input.test_fraction)
    log.info(
        "%d training rows, %d validation rows, %d test rows held out, %d worker(s)",
        len(train_rows),
        len(val_rows),
        len(labels) - len(train_rows) - len(val_rows),
        ctx.world_size,
    )
    return train_rows, val_rows


def batches(data, optim: OptimSection, dp: DataParallelSection, run: RunSection, ctx: DistContext):
    """This rank's shard of the training rows in shuffled batches of ``--batch-size``."""
    sampler = ShardedBatchSampler(len(data[0]), optim.batch_size, ctx.rank, ctx.world_size, run.seed)
    return IndexBatchLoader(data[0], sampler, num_workers=dp.num_workers)


SPEC = TrainSpec(
    "mlp",
    "auc",
    data=read_rows,
    module=lambda net: ClickMLP(net.buckets, net.embed_dim, net.hidden, net.layers),
    model=data_parallel,
    loader=batches,
    loss_fn=lambda: step_fn,
    evaluate=lambda data: lambda m: metrics(m, data[1]),
    export=lambda: {"arch": "click-mlp"},
)


def train(cfg: MlpConfig) -> dict:
    """Train ``cfg`` (this rank's part under torchrun) -> the Trainer's final metrics."""
    return train_job(SPEC, cfg)
