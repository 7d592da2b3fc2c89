"""The keys of ``--ids dynamic`` and the exported id map at prediction time.

The encoder emits a key per field instead of a row (`key_of`: the field in the top bits, the value's low 48
bits below it; ``-1`` = missing); training maps keys to rows with `idmap.IdMap`, prediction with the map the
run exported (`FrozenIdMap`). numpy only."""

from __future__ import annotations

import numpy as np
from mariana.platform.core.errors import DataError

KEY_BITS = 48
KEY_MASK = np.uint64((1 << KEY_BITS) - 1)
MAX_FIELDS = 1 << (63 - KEY_BITS)  # keys stay non-negative int64
MIX1, MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)  # splitmix64 multipliers


def key_of(raw: np.ndarray, known: np.ndarray) -> np.ndarray:
    """Keys int64 [n, F] of raw values uint64 [n, F] (small ints or 64-bit hashes), ``known`` bool [n, F]:
    the field in the top bits, the value's low 48 bits below it (integer ids below 2^48 stay exact);
    ``-1`` where the value is missing."""
    n, F = raw.shape
    if F > MAX_FIELDS:
        raise DataError(f"--ids dynamic supports at most {MAX_FIELDS} fields per record, got {F}")
    field = (np.arange(F, dtype=np.uint64) << np.uint64(KEY_BITS))[None, :]
    keys = ((raw & KEY_MASK) | field).astype(np.int64)
    keys[~known] = -1
    return keys


class FrozenIdMap:
    """The exported map at prediction time: ``lookup(keys [n, F]) -> rows [n, F]`` (unmapped -> OOV), from
    ``row_key`` [F R] alone (sorted once; `np.searchsorted` per request)."""

    def __init__(self, row_key: np.ndarray, num_fields: int, rows_per_field: int):
        row_key = np.asarray(row_key, np.int64)
        self.F, self.R = num_fields, rows_per_field
        rows = np.flatnonzero(row_key >= 0)
        order = np.argsort(row_key[rows], kind="stable")
        self.keys, self.rows = row_key[rows][order], rows[order]

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, np.int64)
        rows = np.broadcast_to(np.arange(self.F, dtype=np.int64) * self.R, keys.shape).copy()
        if len(self.keys):
            pos = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
            hit = (self.keys[pos] == keys) & (keys >= 0)
            rows[hit] = self.rows[pos[hit]]
        return rows
