"""``mariana vision train``: the platform glue. `train` builds a run's parts from the config's sections (the
net from `model`, the input from `loaders`, the step, the evaluation from `evaluate`, the export) and hands
them to the platform's `build_trainer` (`SPEC`): K = 1 data parallel (the core `ModuleStep`, or the fast
recipe's `fast_recipe.FastStep`, with DDP), K > 1 pipeline model parallel x data parallel (`stages`)."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.export import export_model, warm_start
from mariana.platform.core.rundir import start_run
from mariana.platform.core.steps import ModuleStep, autocast_for, unwrap
from mariana.platform.dp.ddp import apply_data_parallel
from mariana.platform.pipeline.step import PipelineStep
from mariana.platform.runtime.dist import init_distributed, teardown
from mariana.platform.train.spec import TrainSpec, build_trainer

from .configs import VisionConfig
from .data import MEAN, STD, DecodedImages, make_prepare, open_source, subset_indices
from .evaluate import evaluate_cached, pipeline_eval_fn
from .fast_recipe import FastStep, init_whitening_from
from .loaders import load_decoded, report_skipped, training_loader, use_cache
from .model import build_model, check_input_size, num_params
from .stages import PipelineLoader, build_pipeline, merged_exporter

log = logging.getLogger("mariana")


def train(cfg: VisionConfig) -> dict[str, Any]:
    """Train on cfg.data -> the final metrics (top1/top5 on --eval-data, skipped images, parameters)."""
    ctx = init_distributed(cfg.device, cfg.timeout)
    try:
        return _train(cfg, ctx)
    finally:
        teardown(ctx)


def _train(cfg: VisionConfig, ctx) -> dict[str, Any]:
    run, _ = start_run(cfg, ctx.rank, ctx.is_main)
    device, net, inp = ctx.device, cfg.net, cfg.input
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    src = open_source(cfg.data)
    cached = use_cache(inp, net, cfg.model_parallel, len(src))
    classes = src.classes
    # the model first: a model that cannot take the image size fails before minutes of decoding
    model = build_model(net.model, len(classes), net.image_size, net.dropout)
    check_input_size(model, net.model, net.image_size)
    if net.channels_last:
        model = model.to(memory_format=torch.channels_last)
    data, skipped = None, []
    decoding = (net.image_size, inp.decode, cfg.num_workers, device)
    if cached:
        data = load_decoded(src, cfg.data, *decoding, inp.limit, progress=ctx.is_main and cfg.progress)
        skipped = data.bad
        n_train = len(data)
    else:
        n_train = len(subset_indices(len(src), inp.limit))
    eval_data = None
    if cfg.eval_data:
        held_out = open_source(cfg.eval_data, classes)
        eval_data = load_decoded(held_out, cfg.eval_data, *decoding, cfg.eval_limit)
    log.info(
        "data: %d training images (%s), %d classes, %s",
        n_train,
        "decoded once" if cached else "streamed",
        len(classes),
        f"{len(eval_data)} eval images" if eval_data is not None else "no eval data",
    )
    smoothing = net.label_smoothing
    loss_fn = lambda logits, y: F.cross_entropy(logits.float(), y, label_smoothing=smoothing)  # noqa: E731
    export = _exporter(cfg, ctx.is_main, run, classes, n_train)
    if cfg.model_parallel == 1:
        parts = _data_parallel_parts(cfg, ctx, model, loss_fn, data, src, eval_data, skipped, export)
        final = build_trainer(SPEC, cfg, ctx, run, parts).fit()
    else:
        parts = _pipeline_parts(cfg, ctx, run, model, loss_fn, data, eval_data, export)
        final = build_trainer(SPEC, cfg, ctx, run, parts, desc="train (pipeline)").fit()
        final.update(parts["step"].summary())
        if not math.isfinite(final.get("train_loss", 0.0)):
            log.warning("training loss is not finite")
    final["skipped_images"] = len(skipped)
    final["params"] = num_params(model)
    if ctx.is_main:
        if skipped:
            run.write_final({"skipped": [{"path": p, "reason": r} for p, r in skipped]}, "skipped.json")
        run.write_final(final)
        # RUN/logs only (DEBUG): the console's last line states the result
        log.debug("final %s", json.dumps({k_: v for k_, v in final.items() if not isinstance(v, list)}))
    return final


SPEC = TrainSpec("vision", "top1")  # its pieces built here (`_data_parallel_parts`, `_pipeline_parts`)


def _exporter(cfg: VisionConfig, is_main: bool, run, classes: list[str], n_train: int):
    """-> ``export(state_dict, eval_metrics)``: rank 0 writes the model with what `predict` needs (classes,
    image size, normalisation) and the whole config it was trained with."""
    config = {k_: v for k_, v in vars(cfg).items()}
    meta = {
        "app": "vision",
        "model": cfg.model,
        "classes": classes,
        "image_size": cfg.image_size,
        "mean": list(MEAN),
        "std": list(STD),
        "dropout": cfg.dropout,
        "config": config,
        "train_images": n_train,
    }

    def export(state: dict[str, torch.Tensor], eval_metrics: dict) -> None:
        if is_main:
            export_model(
                run.path, state, app="vision", arch=cfg.model, config=config, metrics=eval_metrics, extra=meta
            )

    return export


def _data_parallel_parts(cfg: VisionConfig, ctx, model, loss_fn, data, src, eval_data, skipped, export):
    """K = 1 -> the pieces (step, loader, evaluate, exporter) for `build_trainer`: DDP over the workers,
    from the decoded set ``data`` (`DecodedImages`) or, when it is None, streamed from ``src``
    (`ImageSource`); corrupt streamed images are appended to ``skipped`` (once each)."""
    net = cfg.net
    if net.model == "fastnet":
        init_whitening_from(model, data, src, net.image_size, cfg.limit)
    if cfg.init_from:
        warm_start(model, cfg.init_from, "vision")
    loader = training_loader(cfg.input, net, data, src, cfg.batch_size, cfg.seed, cfg.num_workers, ctx)
    wrapped = apply_data_parallel(model, ctx, None, cfg.grad_comm)
    if net.compile:
        wrapped = torch.compile(wrapped)
    prepare = make_prepare(net, train=True)
    where, seen_bad = cfg.data, {p for p, _ in skipped}

    def step_fn(m, batch):
        if len(batch) == 3:  # streamed: (uint8 images on the device, labels, skipped paths)
            x, y, bad = batch
            new = [p for p in bad if p not in seen_bad]  # count each file once, not once per epoch
            if new:
                seen_bad.update(new)
                skipped.extend((p, "not a decodable image") for p in new)
                report_skipped([(q, "not a decodable image") for q in new], where)
        else:
            x, y = batch
        logits = m(prepare(x))
        return loss_fn(logits, y), len(y)

    eval_fn = None
    if eval_data is not None:
        ev, tta = make_prepare(net, train=False), cfg.eval_tta
        eval_fn = lambda m: evaluate_cached(m, eval_data, ev, tta, rank=ctx.rank, world=ctx.world_size)  # noqa: E731
    step = (FastStep if net.recipe == "fast" else ModuleStep)(cfg, wrapped, step_fn, ctx)
    exporter = lambda metrics, _step: export(unwrap(wrapped).state_dict(), metrics)  # noqa: E731
    return {"step": step, "loader": loader, "evaluate": eval_fn, "exporter": exporter}


def _pipeline_parts(cfg: VisionConfig, ctx, run, model, loss_fn, data: DecodedImages, eval_data, export):
    """K > 1 -> the pieces (step, loader, evaluate, exporter) for `build_trainer`: pipeline model parallel
    x data parallel from the decoded set; the stages' weights are merged into one model for the export."""
    k, net, pipe = cfg.model_parallel, cfg.net, cfg.pipeline
    if not ctx.distributed:
        raise MarianaError(f"--model-parallel {k} needs --workers >= {k} (one process per stage)")
    if cfg.init_from:
        warm_start(model, cfg.init_from, "vision")
    ev = make_prepare(net, train=False)
    sample = lambda: ev(data.images[: cfg.batch_size // pipe.micro_batches])  # noqa: E731
    autocast = lambda: autocast_for(cfg, ctx.device)  # noqa: E731
    pp = build_pipeline(model, pipe, ctx, loss_fn, sample, cfg.grad_comm, autocast)
    loader = PipelineLoader(data, pp, cfg.batch_size, cfg.seed)
    # the torch schedule's shapes fixed at setup, not inferred in the first step (host reads)
    example = (cfg.batch_size, data.images[: cfg.batch_size] if pp.is_first else None)
    step = PipelineStep(cfg, pp, ctx, run, make_prepare(net, train=True), example)
    fresh = lambda: build_model(net.model, len(data.classes), net.image_size, net.dropout)  # noqa: E731
    eval_fn = None
    if eval_data is not None:
        eval_fn = pipeline_eval_fn(eval_data, ev, pipe.micro_batches, ctx.device)
    exporter = merged_exporter(step, fresh, export, ctx.is_main)
    return {"step": step, "loader": loader, "evaluate": eval_fn, "exporter": exporter}
