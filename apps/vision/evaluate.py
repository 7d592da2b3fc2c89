"""``mariana vision eval``: top-1/top-5 accuracy of an exported run on held-out images."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from mariana.platform.core.atomic import atomic_write_text
from mariana.platform.core.errors import MarianaError
from mariana.platform.dp.dist import resolve_device

from .data import StreamingImages, collate_stream, normalize, open_source
from .predict import load_classifier
from .train import topk_correct


def evaluate_run(
    run_dir: str | Path, data: str | Path, batch_size: int = 256, device: str = "auto", num_workers: int = 0
) -> dict:
    """Score ``RUN/model.safetensors`` on ``data`` (.tar or folder); writes and returns ``RUN/eval.json``
    ``{"top1": %, "top5": %, "images": n, "skipped": n, "data": path}``. Images stream through a
    DataLoader (decode in workers), so the set may be larger than memory."""
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
            logits = clf.model(normalize(x.to(dev, non_blocking=True))).float()
            a, b = topk_correct(logits, y.to(dev))
            c1, c5, n = c1 + a, c5 + b, n + len(y)
    if n == 0:
        raise MarianaError(f"{data}: no decodable images to evaluate")
    result = {
        "top1": 100.0 * c1 / n,
        "top5": 100.0 * c5 / n,
        "images": n,
        "skipped": len(skipped),
        "skipped_paths": skipped[:100],
        "data": str(data),
    }
    atomic_write_text(Path(run_dir) / "eval.json", json.dumps(result, indent=2) + "\n")
    return result
