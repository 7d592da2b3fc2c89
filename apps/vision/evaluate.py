"""Top-1/top-5 accuracy: of an exported run on held-out images (``mariana vision eval``, `evaluate_run`),
and of the model being trained on the decoded held-out set (`evaluate_cached` in one process or data
parallel, `pipeline_eval_fn` over pipeline stages)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from mariana.platform.cli.console import progress
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.evaluator import topk_correct
from mariana.platform.core.rundir import write_eval_result
from mariana.platform.runtime.dist import resolve_device

from .data import DecodedImages, Prepare, StreamingImages, collate_stream, open_source, subset_indices
from .fast_recipe import tta_mode, tta_probabilities
from .predict import load_classifier


def evaluate_run(
    run_dir: str | Path,
    data: str | Path,
    batch_size: int = 256,
    device: str = "auto",
    num_workers: int = 0,
    out: str | Path | None = None,
    tta: bool | str = False,
    limit: int = 0,
) -> dict:
    """Score ``RUN/model.safetensors`` on ``data`` (.tar or folder), streamed (any size) -> ``{"top1": %,
    "top5": %, "images", "skipped", "data": absolute path, "tta": bool, "tta_mode"}``, also written to ``out``
    (default ``RUN/eval/<data name>.json``). ``tta``: `Classifier.probabilities`; ``limit``: `subset_indices`."""
    if batch_size < 1 or num_workers < 0:
        raise MarianaError(f"batch_size must be >= 1 and num_workers >= 0, got {batch_size}, {num_workers}")
    dev = resolve_device(device)
    clf = load_classifier(run_dir, dev)
    src = open_source(data, clf.classes)
    ds = StreamingImages(src, clf.image_size)
    if limit:
        ds = torch.utils.data.Subset(ds, subset_indices(len(ds), limit))
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=batch_size,
        collate_fn=collate_stream,
        num_workers=num_workers,
        pin_memory=dev.type == "cuda",
    )
    c1 = c5 = n = 0
    skipped: list[str] = []
    with torch.no_grad():
        for x, y, bad in progress(loader, len(loader), f"eval {Path(data).name}"):
            skipped += bad
            if len(y) == 0:
                continue
            # the classifier's own normalisation and TTA, as classify and serving use them
            probs = clf.probabilities(x.to(dev, non_blocking=True), tta)
            a, b = topk_correct(probs, y.to(dev))
            c1, c5, n = c1 + a, c5 + b, n + len(y)
    if n == 0:
        raise MarianaError(f"{data}: no decodable images to evaluate")
    result = {
        "top1": 100.0 * c1 / n,
        "top5": 100.0 * c5 / n,
        "images": n,
        "skipped": len(skipped),
        "skipped_paths": skipped[:100],
        "data": os.path.abspath(data),
        "tta": tta_mode(tta) != "none",
        "tta_mode": tta_mode(tta),
    }
    write_eval_result(result, run_dir, data, out=out)
    return result


def _summed(c1: float, c5: float, n: float, device, distributed: bool) -> dict[str, float]:
    """This rank's hit counts summed over every rank (when ``distributed``) -> {top1 %, top5 %, images}."""
    counts = torch.tensor([c1, c5, n], dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(counts)
    c1, c5, n = counts.tolist()
    return {"top1": 100.0 * c1 / max(1, n), "top5": 100.0 * c5 / max(1, n), "images": n}


def evaluate_cached(
    model: torch.nn.Module, data: DecodedImages, prepare: Prepare, tta="none", batch_size=500, rank=0, world=1
) -> dict[str, float]:
    """top1/top5 (%) of ``model`` on this rank's shard of ``data`` (uint8 images turned into model input by
    ``prepare``), summed over ranks (all ranks call); ranked by the mean probabilities of ``tta``'s views
    (`fast_recipe.tta_views`)."""
    c1 = c5 = n = 0
    model.eval()
    with torch.no_grad():
        for lo in range(rank * batch_size, len(data), batch_size * world):
            x = prepare(data.images[lo : lo + batch_size])
            y = data.labels[lo : lo + batch_size]
            a, b = topk_correct(tta_probabilities(model, x, tta), y)
            c1, c5, n = c1 + a, c5 + b, n + len(y)
    return _summed(c1, c5, n, None, world > 1)


def pipeline_eval_fn(data: DecodedImages, prepare: Prepare, micro_batches: int, device) -> Callable:
    """-> ``eval_fn(pipeline) -> {top1, top5, images}``: the first stage feeds ``data`` in (through
    ``prepare``) in batches of at least ``micro_batches``, the last counts the hits, summed over all ranks."""

    def eval_fn(p) -> dict[str, float]:
        bs = max(micro_batches, 250)
        c1 = c5 = n = 0
        for lo in range(p.dp_index * bs, len(data), bs * p.dp_size):
            x = data.images[lo : lo + bs]
            y = data.labels[lo : lo + bs]
            m = min(micro_batches, len(y))
            logits = p.schedule.forward(prepare(x) if p.is_first else None, len(y)) if len(y) >= m else None
            if p.is_last and logits is not None:
                a, b = topk_correct(logits, y)
                c1, c5, n = c1 + a, c5 + b, n + len(y)
        return _summed(c1, c5, n, device, True)

    return eval_fn
