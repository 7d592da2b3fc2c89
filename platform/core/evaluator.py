"""Evaluation cadence, the monitored metric, the best result so far and early stopping.

An `Evaluator` is one of the Trainer's components: it decides when an evaluation is due (every N optimizer
steps, at the end of every epoch, or only at the end), runs the app's evaluation function through the
strategy, remembers the best value of the monitored metric (with the metric's direction: AUC and top-1 up,
log-loss and WER down) and says when ``patience`` evaluations in a row brought no improvement.

Also the evaluation metrics shared by the apps (training, ``eval`` commands, benchmarks), one implementation
each: `auc_logloss(labels, probs)` -> ``{"auc", "logloss"}`` (click models; `roc_auc`) and
`topk_correct(logits, labels, k)` -> (top-1, top-k) correct counts (classifiers). Their heavy libraries are
imported inside the functions, so importing this module costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import MarianaError

if TYPE_CHECKING:
    import numpy as np
    import torch

EPOCH = -1  # ``--eval-every epoch``: evaluate at the end of every pass over the training data

# Metric name (without an ``eval_``/``val_`` prefix) -> does a larger value mean a better model?
HIGHER_IS_BETTER = {"auc": True, "top1": True, "top5": True, "acc": True, "accuracy": True, "f1": True}
LOWER_IS_BETTER = ("logloss", "loss", "wer", "ser", "cer", "mse", "rmse", "perplexity")
HIGHER_IS_BETTER.update({k: False for k in LOWER_IS_BETTER})


def metric_name(monitor: str) -> str:
    """``eval_auc`` / ``val_auc`` / ``auc`` -> ``auc``."""
    for prefix in ("eval_", "val_"):
        if monitor.startswith(prefix):
            return monitor[len(prefix) :]
    return monitor


def higher_is_better(monitor: str) -> bool:
    """The direction of a known metric; MarianaError for a name whose direction is not known."""
    name = metric_name(monitor)
    if name not in HIGHER_IS_BETTER:
        known = ", ".join(sorted(HIGHER_IS_BETTER))
        raise MarianaError(f"--monitor {monitor!r}: unknown metric (known: {known})")
    return HIGHER_IS_BETTER[name]


class Evaluator:
    """Runs ``fn(model) -> {metric: value}`` when due and tracks the best value of ``monitor``.

    ``every``: N > 0 optimizer steps, `EPOCH` (-1) at each epoch end, 0 only at the end of training.
    ``patience``: stop after this many evaluations in a row without improvement (0: never stop early)."""

    def __init__(
        self,
        fn: Callable[[Any], dict[str, float]],
        every: int = 0,
        monitor: str = "",
        patience: int = 0,
        min_delta: float = 0.0,
    ):
        self.fn, self.every, self.patience, self.min_delta = fn, every, patience, min_delta
        self.monitor = metric_name(monitor) if monitor else ""
        self.maximize = higher_is_better(monitor) if monitor else True
        self.best: float | None = None
        self.best_step = -1
        self.bad = 0
        self.last_step = -1

    def due(self, step: int, epoch_ended: bool) -> bool:
        if self.every == EPOCH:
            return epoch_ended
        return self.every > 0 and step % self.every == 0

    def record(self, step: int, metrics: dict[str, float]) -> bool:
        """Note an evaluation at ``step``; True when it is the best so far (first one included)."""
        self.last_step = step
        if not self.monitor:
            return True
        if self.monitor not in metrics:
            have = ", ".join(sorted(metrics)) or "none"
            raise MarianaError(
                f"--monitor {self.monitor}: the evaluation reports no such metric (it has: {have})"
            )
        value = float(metrics[self.monitor])
        better = self.best is None or (
            value > self.best + self.min_delta if self.maximize else value < self.best - self.min_delta
        )
        if math.isnan(value):
            better = False
        if better:
            self.best, self.best_step, self.bad = value, step, 0
        else:
            self.bad += 1
        return better

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.bad >= self.patience

    def summary(self) -> dict[str, Any]:
        """``best_step`` and ``best_<metric>`` for metrics.json (empty before any evaluation)."""
        if self.best is None:
            return {}
        return {"best_step": self.best_step, f"best_eval_{self.monitor}": self.best, "monitor": self.monitor}

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "bad": self.bad, "last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step = state.get("best"), int(state.get("best_step", -1))
        self.bad, self.last_step = int(state.get("bad", 0)), int(state.get("last_step", -1))


def evaluator_from(
    cfg, fn: Callable[[Any], dict[str, float]] | None, default_monitor: str
) -> Evaluator | None:
    """The Evaluator a job's flags ask for (``--eval-every``, ``--monitor``, ``--early-stop``), or None
    when the job has nothing to evaluate on (then ``--early-stop`` is an error)."""
    if fn is None:
        if getattr(cfg, "early_stop", 0):
            raise MarianaError("--early-stop needs validation data to evaluate on (this job has none)")
        return None
    return Evaluator(fn, cfg.eval_every, cfg.monitor or default_monitor, getattr(cfg, "early_stop", 0))


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC of ``scores`` for 0/1 ``labels`` (both [N]); NaN unless both classes occur. The Mann-Whitney
    statistic, ties at their mean rank: scikit-learn's ``roc_auc_score`` (a test compares) without its import,
    which costs an evaluating process more CPU than the evaluation."""
    import numpy as np

    y = np.asarray(labels, dtype=np.float64)
    n, pos = len(y), float(y.sum())
    _, tie, count = np.unique(np.asarray(scores, dtype=np.float64), return_inverse=True, return_counts=True)
    rank = (np.cumsum(count) - (count - 1) / 2.0)[tie]  # 1-based
    return float((rank @ y - pos * (pos + 1) / 2) / (pos * (n - pos))) if 0 < pos < n else float("nan")


def auc_logloss(labels: np.ndarray, probs: np.ndarray) -> dict[str, float]:
    """ROC AUC and log loss of click probabilities ``probs`` for 0/1 ``labels`` (both [N]). Probabilities
    are clipped to [1e-7, 1 - 1e-7]; AUC is NaN when only one class occurs, both are NaN for no rows."""
    import numpy as np

    y, p = np.asarray(labels, dtype=np.float64), np.clip(np.asarray(probs, dtype=np.float64), 1e-7, 1 - 1e-7)
    logloss = -float(np.mean(y * np.log(p) + (1 - y) * np.log1p(-p))) if len(y) else float("nan")
    return {"auc": roc_auc(y, p), "logloss": logloss}


def topk_correct(logits: torch.Tensor, y: torch.Tensor, k: int = 5) -> tuple[int, int]:
    """(top-1 correct, top-k correct) counts for logits [B, C] and labels [B]."""
    k = min(k, logits.shape[1])
    top = logits.topk(k, dim=1).indices
    hit = top == y.view(-1, 1)
    return int(hit[:, 0].sum()), int(hit.any(dim=1).sum())
