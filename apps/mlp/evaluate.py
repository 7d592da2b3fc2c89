"""AUC/logloss of the MLP click model, in training (eval_fn) and from an exported run (``mariana mlp eval``)."""

from __future__ import annotations

import os

import numpy as np
import torch
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.evaluator import auc_logloss
from mariana.platform.core.export import load_exported
from mariana.platform.core.rundir import write_eval_result
from mariana.platform.data.splits import split_bounds, tail_fractions

from .data import ClickRows, read_libfm
from .model import ClickMLP


@torch.no_grad()
def predict(model: ClickMLP, rows: ClickRows, batch: int = 8192) -> np.ndarray:
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(rows), batch):
        b = rows.__getitems__(list(range(i, min(i + batch, len(rows)))))
        out.append(torch.sigmoid(model(b["ids"].to(device), b["mask"].to(device)).float()).cpu())
    return torch.cat(out).numpy()


def metrics(model: ClickMLP, rows: ClickRows) -> dict[str, float]:
    return auc_logloss(rows.labels.numpy(), predict(model, rows))


def evaluate_run(model_dir: str, data: str, split: str = "all") -> dict:
    """Score an exported ``mariana mlp train`` run on ``data`` (a libFM file). ``split``: all rows, or the
    train/val/test rows of that file as training split them (by row order, with the run's ``limit``,
    ``val_fraction`` and ``test_fraction``). Returns {auc, logloss, rows, skipped, split, data} and writes
    it to `eval_result_path` (``RUN/eval/<data>[-<split>].json``)."""
    state, meta = load_exported(model_dir)
    app = meta.get("app") or meta.get("job")
    if app != "mlp" or "config" not in meta:
        found = f"a {app!r} model" if app else "a model without an app name"
        raise MarianaError(
            f"--model {model_dir}: its model.json describes {found}, not one of `mariana mlp train`"
        )
    cfg = meta["config"]
    model = ClickMLP(cfg["buckets"], cfg["embed_dim"], cfg["hidden"], cfg["layers"])
    model.load_state_dict(state)
    model.eval()
    labels, ids, skipped = read_libfm(data, 0 if split == "all" else cfg.get("limit", 0))
    start, end = split_bounds(
        len(labels), tail_fractions(cfg["val_fraction"], cfg.get("test_fraction", 0.0))
    )[split]
    if end <= start:
        raise MarianaError(
            f"--split {split}: no rows of {data} fall in that split (the run's val_fraction "
            f"{cfg['val_fraction']}, test_fraction {cfg.get('test_fraction', 0.0)})"
        )
    rows = ClickRows(labels[start:end], ids[start:end], cfg["buckets"])
    result = {
        **metrics(model, rows),
        "rows": len(rows),
        "skipped": len(skipped),
        "split": split,
        "data": os.path.abspath(data),
    }
    write_eval_result(result, model_dir, data, split)
    return result
