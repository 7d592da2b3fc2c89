"""Dynamic id -> row map per field (``--ids dynamic``): admission after a minimum count, LFU/LRU eviction.

The encoder emits a key per field instead of a row (`key_of`: the field in the top bits, the value's low 48
bits below it; ``-1`` = missing); training maps keys to rows with `IdMap`, prediction with the map the run
exported (`FrozenIdMap`).

Keys find rows batch by batch in training order; unadmitted keys are counted in a TinyLFU count-min
sketch and use the field's OOV row ``f R``. The rules, and why, are in apps/pctr/README.md, Dynamic ids.
Memory is bounded whatever the number of distinct ids (fixed-size arrays); everything is numpy over the
batch's unique keys and deterministic, so `state_dict` and ``--resume`` continue exactly (the index is
rebuilt from ``row_key`` on load).
"""

from __future__ import annotations

import numpy as np
import torch
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


EMPTY, TOMB = -1, -2
EVICT = ("lfu", "lru")
STATE_ARRAYS = ("row_key", "row_count", "row_last", "used", "sketch", "admitted", "evicted", "oov")


def _unique(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(distinct values in order of first appearance, inverse [n], counts) of int64 ``x`` [n]: Arrow's hash
    kernel, several times faster than `np.unique`'s sort on a batch's keys."""
    import pyarrow as pa

    d = pa.array(x, type=pa.int64()).dictionary_encode()
    inv = d.indices.to_numpy().astype(np.int64)
    uniq = d.dictionary.to_numpy()
    return uniq, inv, np.bincount(inv, minlength=len(uniq))


def _hash(keys: np.ndarray, salt: int = 0) -> np.ndarray:
    """splitmix64 finaliser of int64 keys (non-negative) -> uint64."""
    with np.errstate(over="ignore"):
        z = keys.astype(np.uint64) + np.uint64(salt) * MIX1
        z ^= z >> np.uint64(30)
        z *= MIX2
        z ^= z >> np.uint64(27)
        z *= MIX1
        z ^= z >> np.uint64(31)
    return z


class IdMap:
    """Per-field dynamic map of keys to table rows ``[f R + 1, (f + 1) R)`` (``R = rows_per_field``).

    ``assign(keys [B, F]) -> (rows [B, F], evicted rows [E])`` for training (counts, admits, evicts);
    ``lookup(keys [B, F]) -> rows [B, F]`` read-only (validation, prediction): keys without a row -> OOV.
    ``counters()`` -> admitted / evicted / OOV lookups / rows in use per field."""

    def __init__(
        self,
        num_fields: int,
        rows_per_field: int,
        admit_after: int = 2,
        evict: str = "lfu",
        sketch_width: int = 1 << 18,
        sketch_depth: int = 4,
    ):
        if evict not in EVICT:
            raise ValueError(f"evict must be one of {', '.join(EVICT)}, got {evict!r}")
        if admit_after < 1 or sketch_width < 1 or sketch_depth < 1 or rows_per_field < 2:
            raise ValueError("admit_after, sketch_width, sketch_depth must be >= 1, rows_per_field >= 2")
        self.F, self.R = int(num_fields), int(rows_per_field)
        self.admit_after, self.evict = int(admit_after), evict
        self.exact_limit = 1 << 20  # exact victims while the evicting fields hold <= this many rows
        self.samples = 16  # else: the coldest of this many random rows of the field per admitted key
        n = self.F * self.R
        self.row_key = np.full(n, -1, np.int64)  # key held by each row (-1: free; the OOV rows stay -1)
        self.row_count = np.zeros(n, np.int32)  # occurrences (halved with the sketch)
        self.row_last = np.zeros(n, np.int32)  # last step that used the row
        self.used = np.zeros(self.F, np.int64)  # rows in use per field: rows f R + 1 .. f R + used[f]
        self.sketch = np.zeros((sketch_depth, sketch_width), np.int32)
        self.sketch_adds = 0
        self.admitted = np.zeros(self.F, np.int64)
        self.evicted = np.zeros(self.F, np.int64)
        self.oov = np.zeros(self.F, np.int64)  # training lookups of a present id that got the OOV row
        self.step = 0
        # index slots: a power of two >= 1.5 x the rows (load <= 2/3)
        self.T = 1 << max(4, int(np.ceil(np.log2(max(2, 1.5 * self.F * (self.R - 1))))))
        self._rebuild()

    # ------------------------------------------------------------------ open-addressing index
    # ``slot`` holds a row (>= 0), EMPTY or TOMB; the row's key is ``row_key[row]`` (no key copy per slot).
    def _rebuild(self) -> None:
        self.slot = np.full(self.T, EMPTY, np.int32 if self.F * self.R < 2**31 else np.int64)
        self.tombs = 0
        rows = np.flatnonzero(self.row_key >= 0)
        self._insert(self.row_key[rows], rows)

    def _probe(self, keys: np.ndarray, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(row [n] or -1, slot index [n] or -1) of each key (linear probing, vectorised per probe round).
        ``rows``: find the slot holding that row instead (for deleting rows whose key is gone)."""
        mask = self.T - 1
        pos = (_hash(keys) & np.uint64(mask)).astype(np.int64)
        row = np.full(len(keys), -1, np.int64)
        where = np.full(len(keys), -1, np.int64)
        act = np.arange(len(keys))
        while act.size:
            p = pos[act]
            sr = self.slot[p].astype(np.int64)
            if rows is None:
                hit = (sr >= 0) & (self.row_key[np.maximum(sr, 0)] == keys[act])
            else:
                hit = sr == rows[act]
            row[act[hit]] = sr[hit]
            where[act[hit]] = p[hit]
            go = ~hit & (sr != EMPTY)
            act = act[go]
            pos[act] = (p[go] + 1) & mask
        return row, where

    def _insert(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Insert keys (unique, absent from the index) -> rows (``row_key[rows]`` already holds them)."""
        mask = self.T - 1
        pos = (_hash(keys) & np.uint64(mask)).astype(np.int64)
        act = np.arange(len(keys))
        while act.size:
            p = pos[act]
            free = self.slot[p] < 0
            cand, cp = act[free], p[free]
            cp_u, first = np.unique(cp, return_index=True)  # one key per free slot per round
            win = cand[first]
            self.tombs -= int((self.slot[cp_u] == TOMB).sum())
            self.slot[cp_u] = rows[win]
            done = np.zeros(len(keys), bool)
            done[win] = True
            go = ~done[act]
            act = act[go]
            pos[act] = (p[go] + 1) & mask

    def _delete(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Remove the index entries of ``rows`` that held ``keys``."""
        _, where = self._probe(keys, rows)
        where = where[where >= 0]
        self.slot[where] = TOMB
        self.tombs += len(where)
        if self.tombs > self.T // 4:  # long probe chains: start over from row_key
            self._rebuild()

    # ------------------------------------------------------------------ count-min sketch
    def _sketch_add(self, keys: np.ndarray, cnt: np.ndarray) -> np.ndarray:
        """Add ``cnt`` occurrences of ``keys`` (unique) and return their estimated counts."""
        d, w = self.sketch.shape
        est = np.full(len(keys), np.iinfo(np.int32).max, np.int64)
        for i in range(d):
            idx = (_hash(keys, i + 1) % np.uint64(w)).astype(np.int64)
            np.add.at(self.sketch[i], idx, cnt.astype(np.int32))
            est = np.minimum(est, self.sketch[i][idx])
        return est

    def _age(self, n: int) -> None:
        """TinyLFU's reset: after every ``10 x width`` occurrences, halve the sketch and the rows' counts,
        so counts follow recent traffic and ids that died fade out."""
        self.sketch_adds += n
        if self.sketch_adds >= 10 * self.sketch.shape[1]:
            self.sketch >>= 1
            self.row_count >>= 1
            self.sketch_adds //= 2

    # ------------------------------------------------------------------ public
    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Read-only: keys int64 [n, F] -> rows int64 [n, F]; missing or unmapped keys -> the OOV row."""
        keys = np.asarray(keys, np.int64)
        base = np.arange(self.F, dtype=np.int64) * self.R
        rows = np.broadcast_to(base, keys.shape).copy()
        known = keys >= 0
        if known.any():
            uk, inv, _ = _unique(keys[known])
            r, _ = self._probe(uk)
            got = r[inv.reshape(-1)]
            rows[known] = np.where(got >= 0, got, rows[known])
        return rows

    def assign(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Training lookup of one batch, keys int64 [B, F] -> (rows int64 [B, F], evicted rows int64 [E]).

        Updates counts, admits keys whose estimated count reached ``admit_after``, evicts as needed; rows
        the batch uses are never evicted by it. Advances the map's step by one."""
        keys = np.asarray(keys, np.int64)
        F, R = self.F, self.R
        base = np.arange(F, dtype=np.int64) * R
        rows = np.broadcast_to(base, keys.shape).copy()
        known = keys >= 0
        evicted_rows = np.zeros(0, np.int64)
        if not known.any():
            self.step += 1
            return rows, evicted_rows
        uk, inv, cnt = _unique(keys[known])
        urow, _ = self._probe(uk)
        hit = urow >= 0
        self.row_count[urow[hit]] += cnt[hit]
        self.row_last[urow[hit]] = self.step
        miss = np.flatnonzero(~hit)
        if miss.size:
            est = self._sketch_add(uk[miss], cnt[miss])  # counted with admit_after 1 too: LFU compares it
            keep = est >= self.admit_after
            miss, score = miss[keep], est[keep]
            if miss.size:
                evicted_rows = self._admit(uk, score, urow, miss)
        self._age(int(cnt.sum()))
        got = urow[inv.reshape(-1)]
        ok = got >= 0
        fld = np.broadcast_to(np.arange(F), keys.shape)[known]
        self.oov += np.bincount(fld[~ok], minlength=F)
        rows[known] = np.where(ok, got, rows[known])
        self.step += 1
        return rows, evicted_rows

    def _admit(self, uk, score, urow, idx) -> np.ndarray:
        """Give rows to keys ``uk[idx]`` whose estimated counts are ``score`` (sets ``urow[idx]``); returns
        the evicted rows.

        Vectorised over fields: free rows first (hottest keys first), then victims, the coldest rows this
        batch does not use, exact while the evicting fields hold <= ``exact_limit`` rows, else sampled
        (Redis-style, seeded by the step so a resumed run draws the same). Under ``lfu`` a key takes a
        victim's row only if its estimate beats the victim's count (TinyLFU's admission test)."""
        F, R, C = self.F, self.R, self.R - 1
        fields = uk[idx] >> KEY_BITS
        order = np.lexsort((-score, fields))  # by field, hottest first
        idx, fields, score = idx[order], fields[order], score[order]
        n_f = np.bincount(fields, minlength=F)
        rank = np.arange(len(idx)) - np.repeat(np.cumsum(n_f) - n_f, n_f)  # position within its field
        n_free = np.minimum(n_f, C - self.used)
        new_row = np.full(len(idx), -1, np.int64)
        free = rank < n_free[fields]
        new_row[free] = fields[free] * R + 1 + self.used[fields[free]] + rank[free]
        self.used += n_free
        need = n_f - n_free
        evicted = np.zeros(0, np.int64)
        ev_fields = np.flatnonzero(need > 0)
        if ev_fields.size:
            busy = np.zeros(F * R, bool)  # rows this batch uses: never evicted by it
            busy[urow[urow >= 0]] = True
            busy[new_row[free]] = True
            wants = np.flatnonzero(~free)  # the keys that need a victim, by field, hottest first
            got = np.full(len(wants), -1, np.int64)
            if ev_fields.size * C <= self.exact_limit:
                victims = self._victims_exact(ev_fields, need[ev_fields], busy)  # by field, coldest first
                k_f = np.bincount(victims // R, minlength=F)
                wf = fields[wants]
                r = rank[wants] - n_free[wf]
                ok = r < k_f[wf]
                got[ok] = victims
            else:
                got = self._victims_sampled(fields[wants], busy)
            if self.evict == "lfu":  # TinyLFU: only a hotter key replaces a row
                has = got >= 0
                has[has] = score[wants[has]] > self.row_count[got[has]]
                got[~has] = -1
            new_row[wants] = got
            evicted = got[got >= 0]
            self.evicted += np.bincount(evicted // R, minlength=F)
        ok = new_row >= 0  # the rest (no free row, colder than the victims, all rows busy): OOV row
        take, new_rows = idx[ok], new_row[ok]
        self.admitted += np.bincount(fields[ok], minlength=F)
        if len(evicted):
            old = self.row_key[evicted].copy()
            self.row_key[evicted] = -1  # before `_delete`, whose rebuild reads row_key
            self._delete(old, evicted)
        urow[take] = new_rows
        self.row_key[new_rows] = uk[take]
        self.row_count[new_rows] = np.minimum(score[ok], np.iinfo(np.int32).max)
        self.row_last[new_rows] = self.step
        self._insert(uk[take], new_rows)
        return evicted

    def _prio(self, rows: np.ndarray, busy: np.ndarray) -> np.ndarray:
        """Eviction priority of ``rows`` (lower = evicted first); busy rows never."""
        if self.evict == "lfu":  # fewest uses, then least recent
            prio = (self.row_count[rows].astype(np.int64) << 32) | self.row_last[rows].astype(np.int64)
        else:
            prio = self.row_last[rows].astype(np.int64)
        prio[busy[rows]] = np.iinfo(np.int64).max
        return prio

    def _victims_exact(self, ev_fields: np.ndarray, need: np.ndarray, busy: np.ndarray) -> np.ndarray:
        """The ``need[i]`` coldest non-busy rows of each field ``ev_fields[i]``, coldest first, fields in
        order (a field with fewer non-busy rows gives fewer)."""
        R, C = self.R, self.R - 1
        seg = ev_fields[:, None] * R + 1 + np.arange(C)[None, :]  # [E, C] the fields' rows
        prio = self._prio(seg, busy)
        k = np.minimum(need, C - busy[seg].sum(1))
        kmax = int(k.max())
        if kmax <= 0:
            return np.zeros(0, np.int64)
        part = np.argpartition(prio, kmax - 1, axis=1)[:, :kmax]
        part = np.take_along_axis(part, np.argsort(np.take_along_axis(prio, part, 1), 1, kind="stable"), 1)
        return np.take_along_axis(seg, part, 1)[np.arange(kmax)[None, :] < k[:, None]]

    def _victims_sampled(self, fields: np.ndarray, busy: np.ndarray) -> np.ndarray:
        """One victim per key of field ``fields[i]``: the coldest of ``samples`` random rows of the field;
        -1 where all samples are busy or an earlier key of the batch took the same row."""
        R, C = self.R, self.R - 1
        rng = np.random.default_rng([self.step, 0x1D4A9])
        cand = fields[:, None] * R + 1 + rng.integers(0, C, (len(fields), self.samples))
        prio = self._prio(cand, busy)
        j = prio.argmin(1)
        victims = cand[np.arange(len(fields)), j]
        victims[prio[np.arange(len(fields)), j] == np.iinfo(np.int64).max] = -1
        _, first = np.unique(victims, return_index=True)
        dup = np.ones(len(victims), bool)
        dup[first] = False
        victims[dup] = -1
        return victims

    def counters(self) -> dict:
        """Totals and per-field rows in use (JSON-ready)."""
        return {
            "ids_admitted": int(self.admitted.sum()),
            "ids_evicted": int(self.evicted.sum()),
            "ids_oov_lookups": int(self.oov.sum()),
            "ids_rows_in_use": int(self.used.sum()),
            "ids_capacity": self.F * (self.R - 1),
            "ids_rows_in_use_per_field": self.used.tolist(),
        }

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict:
        """Tensors and numbers only (``torch.load(weights_only=True)`` loads it)."""
        sd = {k: torch.from_numpy(getattr(self, k).copy()) for k in STATE_ARRAYS}
        return {**sd, "sketch_adds": int(self.sketch_adds), "step": int(self.step)}

    def load_state_dict(self, sd: dict) -> None:
        """Restore `state_dict`; ValueError if its shape is not this map's (fields, rows, sketch)."""
        if tuple(sd["row_key"].shape) != self.row_key.shape or tuple(sd["sketch"].shape) != self.sketch.shape:
            raise ValueError(
                f"id map of {tuple(sd['row_key'].shape)} rows / sketch {tuple(sd['sketch'].shape)}, expected "
                f"{self.row_key.shape} / {self.sketch.shape}"
            )
        for k in STATE_ARRAYS:
            getattr(self, k)[...] = sd[k].numpy()
        self.sketch_adds, self.step = int(sd["sketch_adds"]), int(sd["step"])
        self._rebuild()

    def load_rows(self, row_key: np.ndarray) -> None:
        """Adopt an exported map (``row_key`` [F R]): counts restart at 1, the sketch empty (warm start)."""
        row_key = np.asarray(row_key, np.int64)
        if row_key.shape != self.row_key.shape:
            raise ValueError(f"id map of {row_key.shape[0]} rows, expected {self.row_key.shape[0]}")
        per = row_key.reshape(self.F, self.R)
        used = per >= 0
        n = used.sum(1)
        held = row_key[row_key >= 0]
        in_order = used[:, 1:] == (np.arange(self.R - 1)[None, :] < n[:, None])  # rows handed out in order
        if (
            used[:, 0].any()  # the OOV rows hold no id
            or not in_order.all()
            or ((per >> KEY_BITS) != np.arange(self.F)[:, None])[used].any()  # a field's keys in its rows
            or len(np.unique(held)) != len(held)
        ):
            raise ValueError("the id map (idmap.row_key) is not a valid map of this model's fields and rows")
        self.row_key[...] = row_key
        self.row_count[...] = (row_key >= 0).astype(np.int64)
        self.row_last[...] = 0
        self.used[...] = n
        self._rebuild()
