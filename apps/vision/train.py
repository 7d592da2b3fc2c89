"""``mariana vision train``: data parallel (K = 1, the core `Trainer` + DDP) or pipeline model parallel x
data parallel (K > 1, `mariana.platform.pipeline`), from JPEGs in a tar shard or a folder.

Input path: when the decoded set fits in ``--cache-gb`` (CIFAR-10: 150 MB) every image is decoded once
(batched ``decode_jpeg``, on the GPU when training there) into one uint8 tensor kept on the training
device; otherwise DataLoader workers read and decode each step (``--num-workers``) into pinned memory and a
prefetch thread copies batches ahead with ``non_blocking=True``. Augmentation (random crop + flip) and
normalisation run on the batch on the training device.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mariana.platform.cli.console import warn_skipped
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.evaluator import evaluator_from
from mariana.platform.core.export import export_model
from mariana.platform.core.loop import Trainer
from mariana.platform.core.metrics import topk_correct
from mariana.platform.core.rundir import start_run
from mariana.platform.core.steps import ModuleStep, autocast_for, unwrap
from mariana.platform.core.warmstart import warm_start
from mariana.platform.dp.ddp import apply_data_parallel
from mariana.platform.dp.sampler import IndexBatchLoader, ShardedBatchSampler
from mariana.platform.pipeline import parallelize_pipeline
from mariana.platform.pipeline.step import PipelineStep
from mariana.platform.runtime.dist import ParallelDims, init_distributed, teardown

from .configs import VisionConfig
from .data import (
    MEAN,
    STD,
    DecodedImages,
    Prefetcher,
    StreamingImages,
    augment_batch,
    collate_stream,
    decode_all,
    gpu_decode_batch,
    normalize,
    open_source,
    subset_indices,
)
from .fastnet import init_whitening
from .model import as_blocks, build_model, num_params
from .recipe import DeviceEpochLoader, FastStep
from .tta import tta_probabilities

WHITEN_INIT_IMAGES = 5000  # training images whose patches initialise fastnet's whitening layer

log = logging.getLogger("mariana")


# ------------------------------------------------------------------------------------------------ loaders
class CachedLoader:
    """`BatchLoader` over a `DecodedImages` (already on the training device): (uint8 [B,3,S,S], int64 [B])."""

    def __init__(self, data: DecodedImages, sampler: ShardedBatchSampler):
        self.data, self.sampler = data, sampler
        self.batches_per_epoch = sampler.batches_per_epoch

    def iterate(self, epoch: int, start: int = 0):
        for idx in self.sampler.batches(epoch, start):
            t = torch.as_tensor(idx, device=self.data.images.device)
            yield self.data.images[t], self.data.labels[t]


class StreamLoader:
    """`BatchLoader` that reads + decodes in DataLoader workers (pinned memory) and prefetches to the
    device: (uint8 [B',3,S,S], int64 [B'], skipped paths); with GPU decoding the workers only read bytes."""

    def __init__(
        self,
        ds: StreamingImages,
        sampler: ShardedBatchSampler,
        num_workers: int,
        device: torch.device,
        indices: list[int] | None = None,
    ):
        # ``indices``: the --limit subset; the sampler then draws positions 0..len(indices)-1 within it
        subset = torch.utils.data.Subset(ds, indices) if indices is not None else ds
        self.inner = IndexBatchLoader(
            subset, sampler, collate_stream, num_workers, pin_memory=device.type == "cuda"
        )
        self.device = device
        self.batches_per_epoch = sampler.batches_per_epoch
        # raw bytes (GPU decoding): decode in the prefetch thread so that it overlaps the training step
        self.transform = None if ds.decode else gpu_decode_batch(ds.size, device)

    def iterate(self, epoch: int, start: int = 0):
        it = self.inner.iterate(epoch, start)
        return iter(Prefetcher(it, depth=3, device=self.device, transform=self.transform))


class PipelineLoader:
    """Pipeline batches from a cached set: stage 0 gets images, the last stage labels, all the size."""

    def __init__(self, data: DecodedImages, sampler: ShardedBatchSampler, first: bool, last: bool):
        self.data, self.sampler, self.first, self.last = data, sampler, first, last
        self.batches_per_epoch = sampler.batches_per_epoch

    def iterate(self, epoch: int, start: int = 0):
        for idx in self.sampler.batches(epoch, start):
            t = torch.as_tensor(idx, device=self.data.images.device)
            yield (
                self.data.images[t] if self.first else None,
                self.data.labels[t] if self.last else None,
                len(idx),
            )


# ------------------------------------------------------------------------------------------------ pieces
def decode_device(cfg: VisionConfig, device: torch.device) -> torch.device:
    if cfg.decode == "cuda" or (cfg.decode == "auto" and device.type == "cuda"):
        if not torch.cuda.is_available():
            raise MarianaError("--decode cuda needs a CUDA device")
        return device if device.type == "cuda" else torch.device("cuda")
    return torch.device("cpu")


def decode_workers(cfg: VisionConfig, device: torch.device) -> int:
    """Worker processes for the decode-once cache: ``--num-workers`` when decoding on the CPU (chunks decoded
    in parallel, the same pixels as one process), 0 with nvJPEG (decoded batched in this process)."""
    return cfg.num_workers if decode_device(cfg, device).type == "cpu" else 0


def load_images(
    path: str, cfg: VisionConfig, device: torch.device, limit: int, classes=None, progress: bool = False
) -> DecodedImages:
    src = open_source(path, classes)
    data = decode_all(
        src,
        cfg.image_size,
        decode_device(cfg, device),
        limit,
        progress=progress,
        workers=decode_workers(cfg, device),
    )
    report_skipped(data.bad, str(path))
    data.images = data.images.to(device)
    data.labels = data.labels.to(device)
    return data


def report_skipped(bad: list[tuple[str, str]], where: str) -> None:
    """The shared skipped-input warning for ``bad`` [(path, reason)] of ``where`` (the data set)."""
    warn_skipped(where, len(bad), bad, "corrupt image", log=log)


def check_input_size(model: torch.nn.Module, cfg: VisionConfig) -> None:
    """One forward pass of a zero image [1,3,S,S] in eval mode (no RNG drawn, no state changed), so that a
    model that cannot take S px input (e.g. ``alexnet`` at 32 px) fails here with a clear message instead
    of a shape error inside the training loop."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(1, 3, cfg.image_size, cfg.image_size))
    except RuntimeError as e:
        raise MarianaError(
            f"--model {cfg.model} cannot take {cfg.image_size} px images ({str(e).splitlines()[0][:160]}); "
            "raise --image-size (224 for ImageNet models) or pick a CIFAR model (cifar-fast, resnet9, mariana-cnn-32)"
        ) from None
    finally:
        model.train(was)


def make_prepare(cfg: VisionConfig, train: bool):
    """uint8 batch on the device -> augmented (training) and normalised float batch."""

    def prepare(x: torch.Tensor) -> torch.Tensor:
        # alt-flip-translate runs in the loader (recipe.DeviceEpochLoader): its flips depend on the epoch
        if train and cfg.augment not in ("none", "alt-flip-translate"):
            x = augment_batch(x, pad=cfg.image_size // 8 if cfg.augment == "flip-crop" else 0)
        return normalize(x, channels_last=cfg.channels_last)

    return prepare


def evaluate_cached(
    model: torch.nn.Module,
    data: DecodedImages,
    cfg: VisionConfig,
    batch_size: int = 500,
    rank: int = 0,
    world: int = 1,
) -> dict[str, float]:
    """top1/top5 (%) of ``model`` on this rank's shard of ``data``, summed over ranks (all ranks call);
    ranked by the mean probabilities of ``--eval-tta``'s views."""
    prepare = make_prepare(cfg, train=False)
    c1 = c5 = n = 0
    model.eval()
    with torch.no_grad():
        for lo in range(rank * batch_size, len(data), batch_size * world):
            x = prepare(data.images[lo : lo + batch_size])
            y = data.labels[lo : lo + batch_size]
            a, b = topk_correct(tta_probabilities(model, x, cfg.eval_tta), y)
            c1, c5, n = c1 + a, c5 + b, n + len(y)
    counts = torch.tensor([c1, c5, n], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(counts)
    c1, c5, n = counts.tolist()
    return {"top1": 100.0 * c1 / max(1, n), "top5": 100.0 * c5 / max(1, n), "images": n}


# ------------------------------------------------------------------------------------------------ train
def train(cfg: VisionConfig) -> dict[str, Any]:
    """Train on cfg.data -> the final metrics (top1/top5 on --eval-data, skipped images, parameters)."""
    ctx = init_distributed(cfg.device, cfg.timeout)
    try:
        return _train(cfg, ctx)
    finally:
        teardown(ctx)


def _use_cache(cfg: VisionConfig, n_images: int) -> bool:
    """Whether the decoded training set is kept in memory (--cache, --cache-gb); `MarianaError` where the
    recipe needs it (--augment alt-flip-translate, --model-parallel K > 1) and it does not fit."""
    est_gb = n_images * 3 * cfg.image_size**2 / 1e9
    use_cache = cfg.cache == "on" or (cfg.cache == "auto" and est_gb <= cfg.cache_gb)
    if cfg.augment == "alt-flip-translate" and not use_cache:
        raise MarianaError(
            f"--augment alt-flip-translate needs the decoded set in memory; it needs {est_gb:.1f} GB "
            f"(> --cache-gb {cfg.cache_gb}); raise --cache-gb or use --cache on"
        )
    if cfg.model_parallel > 1 and not use_cache:
        raise MarianaError(
            f"--model-parallel {cfg.model_parallel} reads from the decoded-image cache; the data needs "
            f"{est_gb:.1f} GB (> --cache-gb {cfg.cache_gb}); raise --cache-gb or use --cache on"
        )
    return use_cache


def _decode_training_set(cfg: VisionConfig, src, device: torch.device, progress: bool) -> DecodedImages:
    """The training images decoded once onto ``device`` (the corrupt ones reported and listed in ``.bad``)."""
    data = decode_all(
        src,
        cfg.image_size,
        decode_device(cfg, device),
        cfg.limit,
        progress=progress,
        workers=decode_workers(cfg, device),
    )
    report_skipped(data.bad, cfg.data)
    data.images, data.labels = data.images.to(device), data.labels.to(device)
    return data


def _exporter(cfg: VisionConfig, ctx, run, classes: list[str], n_train: int):
    """-> ``export(state_dict, eval_metrics)``: rank 0 writes the model with what `predict` needs (classes,
    image size, normalisation, config)."""
    meta = {
        "app": "vision",
        "model": cfg.model,
        "classes": classes,
        "image_size": cfg.image_size,
        "mean": list(MEAN),
        "std": list(STD),
        "dropout": cfg.dropout,
        "config": {k_: v for k_, v in vars(cfg).items()},
        "train_images": n_train,
    }

    def export(state: dict[str, torch.Tensor], eval_metrics: dict) -> None:
        if ctx.is_main:
            export_model(
                run.path,
                state,
                app="vision",
                arch=cfg.model,
                config=meta["config"],
                metrics=eval_metrics,
                extra=meta,
            )

    return export


def _train(cfg: VisionConfig, ctx) -> dict[str, Any]:
    run, _ = start_run(cfg, ctx.rank, ctx.is_main)
    device = ctx.device
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    src = open_source(cfg.data)
    use_cache = _use_cache(cfg, len(src))
    classes = src.classes
    # the model first: a model that cannot take the image size fails before minutes of decoding
    model = build_model(cfg.model, len(classes), cfg.image_size, cfg.dropout)
    check_input_size(model, cfg)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    data, skipped = None, []
    if use_cache:
        data = _decode_training_set(cfg, src, device, ctx.is_main and cfg.progress)
        skipped = data.bad
        n_train = len(data)
    else:
        n_train = len(subset_indices(len(src), cfg.limit))
    eval_data = None
    if cfg.eval_data:
        eval_data = load_images(cfg.eval_data, cfg, device, cfg.eval_limit, classes)
    log.info(
        "data: %d training images (%s), %d classes, %s",
        n_train,
        "decoded once" if use_cache else "streamed",
        len(classes),
        f"{len(eval_data)} eval images" if eval_data is not None else "no eval data",
    )
    loss_fn = lambda logits, y: F.cross_entropy(logits.float(), y, label_smoothing=cfg.label_smoothing)  # noqa: E731
    export = _exporter(cfg, ctx, run, classes, n_train)
    if cfg.model_parallel == 1:
        final = _train_data_parallel(cfg, ctx, run, model, loss_fn, data, src, eval_data, skipped, export)
    else:
        final = _train_pipeline(cfg, ctx, run, model, loss_fn, data, eval_data, export)
    final["skipped_images"] = len(skipped)
    final["params"] = num_params(model)
    if ctx.is_main:
        if skipped:
            run.write_final({"skipped": [{"path": p, "reason": r} for p, r in skipped]}, "skipped.json")
        run.write_final(final)
        # RUN/logs only (DEBUG): the console's last line states the result
        log.debug("final %s", json.dumps({k_: v for k_, v in final.items() if not isinstance(v, list)}))
    return final


def _train_data_parallel(cfg, ctx, run, model, loss_fn, data, src, eval_data, skipped, export):
    """K = 1: the core `Trainer` with DDP over the workers, from the decoded set (``data``) or streamed
    from ``src``; corrupt streamed images are appended to ``skipped`` -> the final metrics."""
    if cfg.model == "fastnet":
        init_whitening_from(model, data, src, cfg)
    if cfg.init_from:
        warm_start(model, cfg.init_from, "vision")

    if cfg.augment == "alt-flip-translate":
        loader = DeviceEpochLoader(data, cfg.batch_size, ctx.rank, ctx.world_size, cfg.seed)
    elif data is not None:
        sampler = ShardedBatchSampler(len(data), cfg.batch_size, ctx.rank, ctx.world_size, cfg.seed)
        loader = CachedLoader(data, sampler)
    else:
        on_gpu_decode = decode_device(cfg, ctx.device).type == "cuda"
        ds = StreamingImages(src, cfg.image_size, decode=not on_gpu_decode)
        idx = subset_indices(len(src), cfg.limit)
        sampler = ShardedBatchSampler(len(idx), cfg.batch_size, ctx.rank, ctx.world_size, cfg.seed)
        loader = StreamLoader(ds, sampler, cfg.num_workers, ctx.device, idx)
    wrapped = apply_data_parallel(model, ctx, None, cfg.grad_comm)
    if cfg.compile:
        wrapped = torch.compile(wrapped)
    prepare = make_prepare(cfg, train=True)

    seen_bad = {p for p, _ in skipped}

    def step_fn(m, batch):
        if len(batch) == 3:  # streamed: (uint8 images on the device, labels, skipped paths)
            x, y, bad = batch
            new = [p for p in bad if p not in seen_bad]  # count each file once, not once per epoch
            if new:
                seen_bad.update(new)
                skipped.extend((p, "not a decodable image") for p in new)
                report_skipped([(q, "not a decodable image") for q in new], cfg.data)
        else:
            x, y = batch
        logits = m(prepare(x))
        return loss_fn(logits, y), len(y)

    eval_fn = None
    if eval_data is not None:
        eval_fn = lambda m: evaluate_cached(m, eval_data, cfg, rank=ctx.rank, world=ctx.world_size)  # noqa: E731
    step_cls = FastStep if cfg.recipe == "fast" else ModuleStep
    trainer = Trainer(
        cfg,
        step_cls(cfg, wrapped, step_fn, ctx),
        loader,
        ctx,
        run,
        evaluator=evaluator_from(cfg, eval_fn, "top1"),
        exporter=lambda metrics, step: export(unwrap(wrapped).state_dict(), metrics),
    )
    return trainer.fit()


def init_whitening_from(model, data, src, cfg: VisionConfig) -> None:
    """fastnet's whitening layer from the first `WHITEN_INIT_IMAGES` training images (decoded set), or from
    that many images decoded for it (streamed input); the same images on every rank."""
    if data is not None:
        sample = data.images[:WHITEN_INIT_IMAGES]
    else:
        sample = decode_all(src, cfg.image_size, limit=min(cfg.limit or len(src), WHITEN_INIT_IMAGES)).images
    init_whitening(model, normalize(sample))


def _pipeline_eval_fn(cfg: VisionConfig, ctx, eval_data: DecodedImages):
    """-> ``eval_fn(pipeline) -> {top1, top5, images}``: the first stage feeds ``eval_data`` in, the last
    counts the hits, summed over every rank."""

    def eval_fn(p) -> dict[str, float]:
        ev = make_prepare(cfg, train=False)
        bs = max(cfg.micro_batches, 250)
        c1 = c5 = n = 0
        for lo in range(p.dp_index * bs, len(eval_data), bs * p.dp_size):
            x = eval_data.images[lo : lo + bs]
            y = eval_data.labels[lo : lo + bs]
            m = min(cfg.micro_batches, len(y))
            logits = p.schedule.forward(ev(x) if p.is_first else None, len(y)) if len(y) >= m else None
            if p.is_last and logits is not None:
                a, b = topk_correct(logits, y)
                c1, c5, n = c1 + a, c5 + b, n + len(y)
        counts = torch.tensor([c1, c5, n], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(counts)
        c1, c5, n = counts.tolist()
        return {"top1": 100.0 * c1 / max(1, n), "top5": 100.0 * c5 / max(1, n), "images": n}

    return eval_fn


def _build_pipeline(cfg: VisionConfig, ctx, model, loss_fn, data: DecodedImages):
    """``model``'s blocks split into --model-parallel stages over a (pipeline x data parallel) mesh,
    balanced by --stage-balance (params, time measured on one micro-batch, or explicit counts)."""
    k = cfg.model_parallel
    mesh = ParallelDims(world_size=ctx.world_size, mp=k).build_mesh(ctx.device.type)
    balance: Any = cfg.stage_balance
    sample = None
    if balance == "time":
        sample = make_prepare(cfg, train=False)(data.images[: cfg.batch_size // cfg.micro_batches])
    elif balance != "params":
        balance = [int(b) for b in balance.split(",")]
    pp = parallelize_pipeline(
        as_blocks(model),
        mesh,
        ctx.device,
        loss_fn,
        cfg.micro_batches,
        balance,
        sample,
        cfg.grad_comm,
        autocast=lambda: autocast_for(cfg, ctx.device),
        schedule=cfg.pipeline_schedule,
    )
    log.info(
        "pipeline: stage %d/%d blocks %s (%d params), gradient group ranks %s",
        pp.stage_index,
        k,
        list(pp.stage._modules),
        sum(p.numel() for p in pp.stage.parameters()),
        pp.dp_ranks,
    )
    return pp


def _train_pipeline(cfg, ctx, run, model, loss_fn, data, eval_data, export):
    """K > 1: pipeline model parallel x data parallel from the decoded set; the stages' weights are merged
    into one model for the export -> the final metrics (with the pipeline's summary)."""
    k = cfg.model_parallel
    if not ctx.distributed:
        raise MarianaError(f"--model-parallel {k} needs --workers >= {k} (one process per stage)")
    if cfg.init_from:
        warm_start(model, cfg.init_from, "vision")
    pp = _build_pipeline(cfg, ctx, model, loss_fn, data)
    sampler = ShardedBatchSampler(len(data), cfg.batch_size, pp.dp_index, pp.dp_size, cfg.seed)
    loader = PipelineLoader(data, sampler, pp.is_first, pp.is_last)
    prepare = make_prepare(cfg, train=True)
    # the torch schedule's shapes fixed at setup, not inferred in the first step (host reads)
    example = (cfg.batch_size, data.images[: cfg.batch_size] if pp.is_first else None)
    step = PipelineStep(cfg, pp, ctx, run, prepare, example)

    def export_merged(metrics: dict, _step: int) -> None:
        merged = step.full_state_dict()  # collective: every stage sends its part to rank 0
        if ctx.is_main:
            fresh = build_model(cfg.model, len(data.classes), cfg.image_size, cfg.dropout)
            as_blocks(fresh).load_state_dict(merged)
            export(fresh.state_dict(), metrics)

    eval_fn = _pipeline_eval_fn(cfg, ctx, eval_data) if eval_data is not None else None
    trainer = Trainer(
        cfg,
        step,
        loader,
        ctx,
        run,
        evaluator=evaluator_from(cfg, eval_fn, "top1"),
        exporter=export_merged,
        desc="train (pipeline)",
    )
    final = trainer.fit()
    final.update(step.summary())
    if not math.isfinite(final.get("train_loss", 0.0)):
        log.warning("training loss is not finite")
    return final
