"""AUC/logloss of the MLP click model, in training (eval_fn) and from an exported run (``mariana mlp eval``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import log_loss, roc_auc_score

from ..core.export import load_exported
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
    p = predict(model, rows)
    y = rows.labels.numpy()
    auc = roc_auc_score(y, p) if 0 < y.sum() < len(y) else float("nan")
    return {"auc": float(auc), "logloss": float(log_loss(y, np.clip(p, 1e-7, 1 - 1e-7), labels=[0, 1]))}


def evaluate_run(model_dir: str, data: str) -> dict:
    state, meta = load_exported(model_dir)
    cfg = meta["config"]
    model = ClickMLP(cfg["buckets"], cfg["embed_dim"], cfg["hidden"], cfg["layers"])
    model.load_state_dict(state)
    model.eval()
    labels, ids, skipped = read_libfm(data)
    result = {
        **metrics(model, ClickRows(labels, ids, cfg["buckets"])),
        "rows": len(labels),
        "skipped": len(skipped),
    }
    (Path(model_dir) / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
