"""``mariana vision eval``: top-1/top-5 accuracy of an exported run on held-out images."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from mariana.platform.core import jsonfile
from mariana.platform.core.atomic import atomic_write_text
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.metrics import topk_correct
from mariana.platform.core.rundir import eval_result_path
from mariana.platform.runtime.dist import resolve_device

from .data import StreamingImages, collate_stream, open_source
from .predict import load_classifier
from .tta import tta_mode


def evaluate_run(
    run_dir: str | Path,
    data: str | Path,
    batch_size: int = 256,
    device: str = "auto",
    num_workers: int = 0,
    out: str | Path | None = None,
    tta: bool | str = False,
) -> dict:
    """Score ``RUN/model.safetensors`` on ``data`` (.tar or folder); returns and writes to ``out`` (default
    ``eval_result_path(run_dir, data)`` = ``RUN/eval/<data name>.json``, one file per evaluated data set)
    ``{"top1": %, "top5": %, "images": n, "skipped": n, "data": absolute path, "tta": bool, "tta_mode"}``.
    ``tta`` (True = "flip", "crops"): rank classes by the mean probabilities of each image's views
    (`Classifier.probabilities`).
    Images stream through a DataLoader (decode in workers), so the set may be larger than memory."""
    if batch_size < 1 or num_workers < 0:
        raise MarianaError(f"batch_size must be >= 1 and num_workers >= 0, got {batch_size}, {num_workers}")
    dev = resolve_device(device)
    clf = load_classifier(run_dir, dev)
    src = open_source(data, clf.classes)
    ds = StreamingImages(src, clf.image_size)
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
        for x, y, bad in loader:
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
    out = Path(out) if out is not None else eval_result_path(run_dir, data)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, jsonfile.dumps(result, indent=2) + "\n")
    return result
