"""libFM reader for the smoke-test job: ``label id:value id:value ...`` (label 1, 0 or -1).

Rows become (label in {0,1}, padded id matrix). Malformed lines are skipped and counted with their line
numbers; a file with no valid row is an error naming the file.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from ..core.errors import DataError

log = logging.getLogger("mariana")


def read_libfm(path: str | Path, limit: int = 0, max_skipped_report: int = 5):
    """Returns (labels float32 [N], ids int64 [N, F] padded with -1, skipped line numbers)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: not a file (expected a libFM file: 'label id:value ...' per line)")
    labels, rows, skipped = [], [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if limit and len(rows) >= limit:
                break
            parts = line.split()
            if not parts:
                continue
            try:
                label = float(parts[0])
                ids = [int(p.split(":", 1)[0]) for p in parts[1:]]
                if label not in (1.0, 0.0, -1.0) or not ids or min(ids) < 0:
                    raise ValueError
            except ValueError:
                skipped.append(lineno)
                continue
            labels.append(1.0 if label > 0 else 0.0)
            rows.append(ids)
    if skipped:
        log.warning(
            "%s: skipped %d malformed line(s), e.g. line(s) %s",
            path,
            len(skipped),
            skipped[:max_skipped_report],
        )
    if not rows:
        raise DataError(f"{path}: no valid libFM rows")
    width = max(map(len, rows))
    ids = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return np.asarray(labels, dtype=np.float32), ids, skipped


class ClickRows(torch.utils.data.Dataset):
    """In-memory rows; ``__getitems__`` returns a whole batch (ids [B, F] hashed, padding -> bucket 0
    with weight 0, labels [B])."""

    def __init__(self, labels: np.ndarray, ids: np.ndarray, buckets: int):
        self.labels = torch.from_numpy(labels)
        ids_t = torch.from_numpy(ids)
        self.mask = (ids_t >= 0).float()
        self.ids = torch.where(ids_t >= 0, ids_t % buckets, torch.zeros_like(ids_t))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return self.__getitems__([i])

    def __getitems__(self, idx: list[int]):
        t = torch.as_tensor(idx)
        return {"ids": self.ids[t], "mask": self.mask[t], "label": self.labels[t]}


SPLITS = ("all", "train", "val", "test")


def split_bounds(n: int, val_fraction: float, test_fraction: float = 0.0) -> dict[str, tuple[int, int]]:
    """Row ranges ``[start, end)`` of each split of ``n`` rows, by row order: train | val | test (the last
    ``test_fraction`` rows are the test split, the ``val_fraction`` before them validate; ``all`` is every
    row). Validation gets at least one row; test gets none when ``test_fraction`` is 0."""
    n_test = int(n * test_fraction)
    n_val = max(1, int(n * val_fraction))
    cut_val, cut_test = max(0, n - n_test - n_val), n - n_test
    return {"all": (0, n), "train": (0, cut_val), "val": (cut_val, cut_test), "test": (cut_test, n)}


def split(
    labels: np.ndarray, ids: np.ndarray, val_fraction: float, buckets: int, test_fraction: float = 0.0
) -> tuple[ClickRows, ClickRows]:
    """(train rows, validation rows) by row order; the test rows (`split_bounds`) are left out."""
    b = split_bounds(len(labels), val_fraction, test_fraction)
    (t0, t1), (v0, v1) = b["train"], b["val"]
    if t1 <= t0:
        raise DataError(f"{len(labels)} rows leave none to train on after the validation and test splits")
    return ClickRows(labels[t0:t1], ids[t0:t1], buckets), ClickRows(labels[v0:v1], ids[v0:v1], buckets)
