"""``mariana vision train``, declared as every app's training is (`SPEC`, a `TrainSpec`: the platform's
`train_job` builds and runs its Trainer). Each builder takes the config sections it reads; with
``--model-parallel`` K = 1 they build data parallel (the core `ModuleStep`, or the fast recipe's
`fast_recipe.FastStep`, with DDP), with K > 1 pipeline model parallel x data parallel (`stages`)."""

from __future__ import annotations

import json
import logging
import math

import torch
import torch.nn.functional as F
from mariana.platform.core.config import DataParallelSection, OptimSection, RunSection
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.export import export_model, warm_start
from mariana.platform.core.steps import ModuleStep, autocast_for
from mariana.platform.dp.ddp import apply_data_parallel
from mariana.platform.pipeline.step import PipelineStep
from mariana.platform.train.spec import TrainSpec, train_job, weights_exporter

from .configs import VisionConfig, VisionEval, VisionNet, VisionPipeline
from .data import MEAN, STD, make_prepare
from .evaluate import evaluate_cached, pipeline_eval_fn
from .fast_recipe import FastStep, init_whitening_from
from .loaders import Images, images, report_skipped, training_loader
from .model import as_blocks, build_model, check_input_size, num_params
from .stages import build_pipeline

log = logging.getLogger("mariana")


def network(data: Images, net: VisionNet, pipeline: VisionPipeline, run: RunSection) -> torch.nn.Module:
    """The classifier on the CPU: checked on one image of the size, channels-last, the fast recipe's
    whitening layer from the training images (K = 1), then ``--init-from``'s weights."""
    model = build_model(net.model, len(data.src.classes), net.image_size, net.dropout)
    check_input_size(model, net.model, net.image_size)
    if net.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if net.model == "fastnet" and pipeline.model_parallel == 1:
        init_whitening_from(model, data.train, data.src, net.image_size, data.limit)
    if run.init_from:
        warm_start(model, run.init_from, "vision")
    what = "decoded once" if data.cached else "streamed"
    held = f"{len(data.heldout)} eval images" if data.heldout is not None else "no eval data"
    log.info("data: %d training images (%s), %d classes, %s", data.n_train, what, len(data.src.classes), held)
    return model


def cross_entropy(net: VisionNet):
    """-> loss(logits [B, C], labels [B]) -> [], label-smoothed, in fp32."""
    return lambda logits, y: F.cross_entropy(logits.float(), y, label_smoothing=net.label_smoothing)


def parallel(module, data: Images, net, pipeline, dp: DataParallelSection, optim: OptimSection, ctx):
    """K = 1: ``module`` on the device in DDP (compiled with --compile); K > 1: this rank's stage of the
    pipeline (`build_pipeline`), balanced on a micro-batch of the training images where asked."""
    if pipeline.model_parallel == 1:
        wrapped = apply_data_parallel(module, ctx, None, dp.grad_comm)
        return torch.compile(wrapped) if net.compile else wrapped
    if not ctx.distributed:
        k = pipeline.model_parallel
        raise MarianaError(f"--model-parallel {k} needs --workers >= {k} (one process per stage)")
    ev = make_prepare(net, train=False)
    sample = lambda: ev(data.train.images[: optim.batch_size // pipeline.micro_batches])  # noqa: E731
    autocast = lambda: autocast_for(dp, ctx.device)  # noqa: E731  (it reads --amp)
    return build_pipeline(module, pipeline, ctx, cross_entropy(net), sample, dp.grad_comm, autocast)


def loss_and_skips(data: Images, net: VisionNet):
    """-> step_fn(model, batch) -> (loss, samples) of a data-parallel step; a streamed batch's corrupt
    images are reported and added to ``data.skipped`` (once each, not once per epoch)."""
    prepare, loss_fn, seen = make_prepare(net, train=True), cross_entropy(net), {p for p, _ in data.skipped}

    def step_fn(m, batch):
        if len(batch) == 3:  # streamed: (uint8 images on the device, labels, skipped paths)
            x, y, bad = batch
            new = [(p, "not a decodable image") for p in bad if p not in seen]
            if new:
                seen.update(p for p, _ in new)
                data.skipped.extend(new)
                report_skipped(new, data.where)
        else:
            x, y = batch
        return loss_fn(m(prepare(x)), y), len(y)

    return step_fn


def make_step(cfg, model, loss_fn, data: Images, net, pipeline, optim, ctx, rundir):
    """The recipe's step: `FastStep` or `ModuleStep` (K = 1), `PipelineStep` (K > 1), whose schedule's
    shapes are fixed here rather than inferred in the first step (host reads)."""
    if pipeline.model_parallel == 1:
        return (FastStep if net.recipe == "fast" else ModuleStep)(cfg, model, loss_fn, ctx)
    example = (optim.batch_size, data.train.images[: optim.batch_size] if model.is_first else None)
    return PipelineStep(cfg, model, ctx, rundir, make_prepare(net, train=True), example)


def scores(data: Images, net: VisionNet, heldout: VisionEval, pipeline: VisionPipeline, ctx):
    """-> fn(model) -> {top1, top5} on the held-out images (with --eval-tta's views at K = 1); None without."""
    if data.heldout is None:
        return None
    ev = make_prepare(net, train=False)
    if pipeline.model_parallel > 1:
        return pipeline_eval_fn(data.heldout, ev, pipeline.micro_batches, ctx.device)
    tta, rank, world = heldout.eval_tta, ctx.rank, ctx.world_size
    return lambda m: evaluate_cached(m, data.heldout, ev, tta, rank=rank, world=world)


def export_keys(data: Images, net: VisionNet, config: dict) -> dict:
    """model.json's ``arch`` and what `predict` needs: classes, image size, normalisation, the config."""
    meta = {"app": "vision", "model": net.model, "classes": data.src.classes, "image_size": net.image_size,
            "mean": list(MEAN), "std": list(STD), "dropout": net.dropout, "config": config,
            "train_images": data.n_train}  # fmt: skip
    return {"arch": net.model, "extra": meta}


def exporter(config, ctx, rundir, app, model, step, export, data: Images, net, pipeline):
    """`weights_exporter` (K = 1); K > 1: every stage sends its weights to rank 0 (a collective: all ranks
    call it), which loads them into an unsplit model and writes that."""
    if pipeline.model_parallel == 1:
        return weights_exporter(config, ctx, rundir, app, model, export)

    def export_merged(metrics: dict, _step: int) -> None:
        merged = step.full_state_dict()
        if ctx.is_main:
            whole = build_model(net.model, len(data.src.classes), net.image_size, net.dropout)
            as_blocks(whole).load_state_dict(merged)
            export_model(rundir.path, whole.state_dict(), app=app, config=config, metrics=metrics, **export)

    return export_merged


def finish(trainer, final: dict, data: Images, module, step, pipeline, ctx, rundir) -> None:
    """The final metrics plus the pipeline's summary, skipped images and parameters; rank 0 writes them."""
    if pipeline.model_parallel > 1:
        final.update(step.summary())
        if not math.isfinite(final.get("train_loss", 0.0)):
            log.warning("training loss is not finite")
    final["skipped_images"] = len(data.skipped)
    final["params"] = num_params(module)
    if ctx.is_main:
        if data.skipped:
            skipped = [{"path": p, "reason": r} for p, r in data.skipped]
            rundir.write_final({"skipped": skipped}, "skipped.json")
        rundir.write_final(final)
        # RUN/logs only (DEBUG): the console's last line states the result
        log.debug("final %s", json.dumps({k: v for k, v in final.items() if not isinstance(v, list)}))


SPEC = TrainSpec("vision", "top1", data=images, module=network, model=parallel, loader=training_loader,
                 loss_fn=loss_and_skips, step=make_step, evaluate=scores, export=export_keys, exporter=exporter,
                 finish=finish)  # fmt: skip


def train(cfg: VisionConfig) -> dict:
    """Train on --data -> the final metrics (top1/top5 on --eval-data, skipped images, parameters)."""
    return train_job(SPEC, cfg)
