"""Evaluation metrics shared by the apps (training, ``eval`` commands, benchmarks): one implementation each.

- `auc_logloss(labels, probs)` -> ``{"auc", "logloss"}`` (scikit-learn; click models);
- `topk_correct(logits, labels, k)` -> (top-1, top-k) correct counts (classifiers).

Heavy libraries are imported inside the functions, so importing this module costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch


def auc_logloss(labels: np.ndarray, probs: np.ndarray) -> dict[str, float]:
    """ROC AUC and log loss of click probabilities ``probs`` for 0/1 ``labels``. Probabilities are clipped
    to [1e-7, 1 - 1e-7]; AUC is NaN when only one class occurs, both are NaN for no rows."""
    import numpy as np
    from sklearn.metrics import log_loss, roc_auc_score

    labels, probs = np.asarray(labels), np.asarray(probs)
    if len(labels) == 0:
        return {"auc": float("nan"), "logloss": float("nan")}
    p = np.clip(probs.astype(np.float64), 1e-7, 1 - 1e-7)
    auc = float(roc_auc_score(labels, p)) if 0 < labels.sum() < len(labels) else float("nan")
    return {"auc": auc, "logloss": float(log_loss(labels, p, labels=[0, 1]))}


def topk_correct(logits: torch.Tensor, y: torch.Tensor, k: int = 5) -> tuple[int, int]:
    """(top-1 correct, top-k correct) counts for logits [B, C] and labels [B]."""
    k = min(k, logits.shape[1])
    top = logits.topk(k, dim=1).indices
    hit = top == y.view(-1, 1)
    return int(hit[:, 0].sum()), int(hit.any(dim=1).sum())
