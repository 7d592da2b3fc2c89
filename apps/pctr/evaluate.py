"""`mariana pctr eval`: AUC and log-loss of an exported run on a data file (streamed in chunks).

Scores with the same `Predictor` the serving module uses, so both give identical probabilities.
Writes ``out`` (the CLI passes ``RUN/eval/<data>[-<split>].json``): {auc, logloss, rows, skipped, split, data}."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from mariana.platform.core.atomic import atomic_write_text
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.metrics import auc_logloss

from .data import ReadStats, count_lines, iter_chunks, parse_split, split_bounds
from .predict import load_predictor


def evaluate_run(
    run_dir: str,
    data: str,
    fmt: str | None = None,
    split: str = "all",
    fractions: str = "0.8,0.1,0.1",
    device: str = "cpu",
    out: str | Path | None = None,
) -> dict:
    """Score ``data`` (the ``split`` of it, by row order) with the run's exported model. Returns the
    result dict and writes it to ``out`` (default: ``eval_result_path(run_dir, data, split)``)."""
    from mariana.platform.core.rundir import eval_result_path

    pred = load_predictor(run_dir, device)
    if pred.image is not None:  # offline scoring shares the training run's image feature cache
        pred.image.use_cache(pred.meta["image"].get("cache") or None)
    if fmt and fmt != pred.format:
        raise MarianaError(f"--format {fmt} but the model in {run_dir} was trained on {pred.format} data")
    a, b = split_bounds(count_lines(data), parse_split(fractions))[split] if split != "all" else (0, None)
    stats = ReadStats()
    labels, probs = [], []
    for chunk in iter_chunks(data, pred.encoder, a, b, stats=stats):
        labels.append(chunk.labels.numpy())
        probs.append(pred.predict(chunk))
    if not labels:
        raise MarianaError(f"{data}: no valid {pred.format} rows to evaluate")
    y, p = np.concatenate(labels), np.concatenate(probs)
    m = auc_logloss(y, p)
    result = {
        "auc": m["auc"],
        "logloss": m["logloss"],
        "rows": int(len(y)),
        "skipped": stats.skipped,
        "skipped_examples": {str(k): v for k, v in list(stats.errors.items())[:10]},
        "split": split,
        "data": str(data),
        "model_version": pred.version,
    }
    out = Path(out) if out is not None else eval_result_path(run_dir, data, split)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    return result
