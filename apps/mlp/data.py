"""libFM data of the smoke-test job: ``label id:value id:value ...`` (label 1, 0 or -1).

Read with the platform's libFM parser (`mariana.platform.data.libfm`) into (label in {0,1}, padded id
matrix; every feature is one-hot). Malformed and featureless lines are skipped and counted by line number.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import numpy as np
import torch
from mariana.platform.cli.console import warn_skipped
from mariana.platform.core.errors import DataError
from mariana.platform.data.libfm import parse_lines
from mariana.platform.data.splits import split_bounds, tail_fractions
from mariana.platform.data.textblocks import open_data, pieces

log = logging.getLogger("mariana")

CHUNK = 8192  # lines parsed at once


def read_libfm(path: str | Path, limit: int = 0, max_skipped_report: int = 5):
    """Returns (labels float32 [N], ids int64 [N, F] padded with -1, skipped line numbers); ``limit``: at
    most that many rows (0: all)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: not a file (expected a libFM file: 'label id:value ...' per line)")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file (expected a libFM file: 'label id:value ...' per line)")
    labels, ids, skipped = [], [], []
    why: dict[int, str] = {}  # line number -> reason, for the console line
    n = 0

    def parse(buf: list[tuple[int, str]]) -> None:
        nonlocal n
        p = parse_lines([line for _, line in buf])
        bad = {buf[i][0] for i in p.errors}
        why.update({buf[i][0]: e for i, e in p.errors.items()})
        has_feature = p.known.any(1) if p.known.shape[1] else np.zeros(len(p), dtype=bool)
        bad.update(buf[p.good[j]][0] for j in np.flatnonzero(~has_feature))
        keep = np.flatnonzero(has_feature)
        if limit:
            keep = keep[: limit - n]
            if n + len(keep) >= limit:  # lines after the last row kept are not read
                last = buf[p.good[keep[-1]]][0] if len(keep) else 0
                bad = {x for x in bad if x < last}
        skipped.extend(sorted(bad))
        labels.append(p.labels[keep])
        ids.append(np.where(p.known, p.ids, -1)[keep])
        n += len(keep)

    buf: list[tuple[int, str]] = []
    with io.TextIOWrapper(open_data(path), encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(pieces(path, text=f), 1):
            if limit and n >= limit:
                break
            if line.strip():
                buf.append((lineno, line))
            if len(buf) >= CHUNK:
                parse(buf)
                buf = []
        if buf and not (limit and n >= limit):
            parse(buf)
    first = {
        k: why.get(k, "no feature (expected 'label id:value ...')") for k in skipped[:max_skipped_report]
    }
    warn_skipped(path, len(skipped), first, log=log)
    if not n:
        raise DataError(f"{path}: no valid libFM rows")
    width = max(int((a >= 0).sum(1).max()) for a in ids if len(a))  # the widest row kept
    out = np.full((n, width), -1, dtype=np.int64)
    i = 0
    for a in ids:
        w = min(width, a.shape[1])
        out[i : i + len(a), :w] = a[:, :w]
        i += len(a)
    return np.concatenate(labels).astype(np.float32), out, skipped


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


def split(
    labels: np.ndarray, ids: np.ndarray, val_fraction: float, buckets: int, test_fraction: float = 0.0
) -> tuple[ClickRows, ClickRows]:
    """(train rows, validation rows) by row order (`split_bounds` of the platform: the last
    ``test_fraction`` of the rows are the test split, the ``val_fraction`` before them validate); the test
    rows are left out."""
    b = split_bounds(len(labels), tail_fractions(val_fraction, test_fraction))
    (t0, t1), (v0, v1) = b["train"], b["val"]
    if t1 <= t0:
        raise DataError(f"{len(labels)} rows leave none to train on after the validation and test splits")
    if v1 <= v0:
        raise DataError(f"{len(labels)} rows leave none to validate on (--val-fraction {val_fraction})")
    return ClickRows(labels[t0:t1], ids[t0:t1], buckets), ClickRows(labels[v0:v1], ids[v0:v1], buckets)
