"""`mariana pctr eval`: AUC and log-loss of an exported run on a data file (streamed in chunks).

Scores with the same `Predictor` the serving module uses, so both give identical probabilities.
Writes ``out`` (the CLI passes ``RUN/eval/<data>[-<split>].json``): {auc, logloss, rows, skipped, split, data}."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from mariana.platform.core.config import read_config_values
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.evaluator import auc_logloss
from mariana.platform.core.rundir import write_eval_result

from .configs import parse_split
from .data.encoding import ReadStats
from .data.reader import ALL_ROWS, ClickSource
from .data.sources import DataSources
from .models.predict import load_predictor


def run_split(run_dir: str | Path, split: str) -> str:
    """The ``train,val,test`` fractions ``run_dir`` was trained with (its config.toml ``split``), or
    MarianaError when the run has no such split: a stream (every row of a file is trained on), a zero
    fraction for ``split`` (e.g. ``--split 1,0,0`` has no val or test rows) or no config.toml to read."""
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise MarianaError(
            f"--split {split}: {path} is missing, so the run's split is unknown; use --split all"
        )
    cfg = read_config_values(path)  # sectioned, or flat (runs of earlier versions)
    if "export_every" in cfg:  # only a stream's config has it
        raise MarianaError(
            f"--split {split}: {run_dir} is a stream run, which trains on every row of its files and has "
            "no train/val/test split; use --split all on held-out files"
        )
    fractions = str(cfg.get("split", "0.8,0.1,0.1"))
    k = ("train", "val", "test").index(split)
    if parse_split(fractions)[k] <= 0:
        raise MarianaError(
            f"--split {split}: the run was trained with --split {fractions}, which has no {split} rows; "
            "use --split all on held-out data"
        )
    return fractions


def evaluate_run(
    run_dir: str,
    data: str | DataSources,
    fmt: str | None = None,
    split: str = "all",
    device: str = "cpu",
    out: str | Path | None = None,
) -> dict:
    """Score ``data`` (a file, a comma-separated list, a folder, or its `DataSources` already resolved; the
    ``split`` of it, by row order, cut with the fractions the run was trained with: its ``RUN/config.toml``
    ``split``) with the run's exported model, read through one `data.reader.ClickSource`. Returns the result
    dict and writes it to ``out`` (default: ``eval_result_path(run_dir, data, split)``). MarianaError for a
    split the run does not have (a zero fraction, a stream run, a run without config.toml)."""
    pred = load_predictor(run_dir, device)
    if pred.image is not None:  # offline scoring shares the training run's image feature cache
        pred.image.use_cache(pred.meta["image"].get("cache") or None)
    if fmt and fmt != pred.format:
        raise MarianaError(f"--format {fmt} but the model in {run_dir} was trained on {pred.format} data")
    a, b = (0, None)  # --split all: the whole source, read without counting its lines first
    fractions = run_split(run_dir, split) if split != "all" else None
    source = ClickSource(data, pred.encoder, parse_split(fractions) if fractions else ALL_ROWS)
    data = str(source)
    if fractions:
        a, b = source.bounds[split]
        if b <= a:
            raise MarianaError(
                f"--split {split}: no rows of {data} fall in the run's {split} split (--split {fractions})"
            )
    stats = ReadStats()
    labels, probs = [], []
    for chunk in source.chunks(a, b, stats=stats):
        labels.append(chunk.labels.numpy())
        probs.append(pred.predict(chunk))
    if not labels:
        raise MarianaError(f"{data}: no valid {pred.format} rows to evaluate")
    y, p = np.concatenate(labels), np.concatenate(probs)
    result = {
        **auc_logloss(y, p),  # auc, logloss
        "rows": int(len(y)),
        "skipped": stats.skipped,
        "skipped_examples": {str(k): v for k, v in list(stats.errors.items())[:10]},
        "split": split,
        "data": str(data),
        "model_version": pred.version,
    }
    write_eval_result(result, run_dir, data, split, out)
    return result
