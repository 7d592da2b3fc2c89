"""The platform's one libSVM/libFM parser: ``label id:value id:value ...`` per line.

Used by the click MLP (`mariana.apps.mlp.data.read_libfm`) and pCTR's encoder. `parse_lines` turns a chunk
of lines into arrays, vectorised when every line is valid, else line by line so that each malformed line
is reported with its reason. Label (when ``has_label``): ``1`` = click, ``0`` or ``-1`` = no click (any
spelling ``float`` reads); features: ``id:value`` (``id`` a non-negative int, ``value`` a float), the
k-th token field k; a line may have no feature but may not be empty; ``num_fields``: at most that many
features per line (None: no limit, the arrays as wide as the chunk's widest valid line).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .textblocks import lines_array


@dataclass
class LibfmRows:
    """The valid lines of a chunk: ``labels`` float32 [n] in {0, 1} (zeros without labels); ``ids`` int64
    [n, F] feature ids (0 where missing); ``vals`` float32 [n, F] (0 where missing); ``known`` bool [n, F]
    (the line has field k); ``good``: their indices in the chunk; ``errors``: index -> why a line was
    skipped."""

    labels: np.ndarray
    ids: np.ndarray
    vals: np.ndarray
    known: np.ndarray
    good: list[int]
    errors: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.labels)


def parse_lines(lines: list[str], num_fields: int | None = None, has_label: bool = True) -> LibfmRows:
    """Parse ``lines`` (see the module docstring); malformed lines are left out and named in ``errors``."""
    fast = _parse_fast(lines, num_fields, has_label)
    return fast if fast is not None else _parse_checked(lines, num_fields, has_label)


def _parse_fast(lines: list[str], F: int | None, has_label: bool) -> LibfmRows | None:
    """Vectorised parse of a chunk whose lines are all valid (numpy converts every token in one call);
    None if any line is not, so that errors are always reported per line by `_parse_checked`."""
    toks = [ln.split() for ln in lines]
    n = len(toks)
    if n == 0:
        return None
    lens = np.fromiter(map(len, toks), dtype=np.int64, count=n)
    nfeat = lens - 1 if has_label else lens
    if lens.min() < 1 or (F is not None and nfeat.max() > F):
        return None
    if F is None:
        F = int(nfeat.max())
    try:  # C-level conversions over the whole chunk (map over builtins, no Python loop per field)
        if has_label:
            lab = np.fromiter(map(float, [t[0] for t in toks]), dtype=np.float64, count=n)
            if not np.isin(lab, (1.0, 0.0, -1.0)).all():
                return None
            feats = [x for t in toks for x in t[1:]]
        else:
            lab = np.zeros(n)
            feats = [x for t in toks for x in t]
        pairs = " ".join(feats).replace(":", " ").split()
        m = len(feats)
        if len(pairs) != 2 * m:  # a token without ':' or with several
            return None
        ident = np.fromiter(map(int, pairs[0::2]), dtype=np.int64, count=m)
        value = np.fromiter(map(float, pairs[1::2]), dtype=np.float32, count=m)
    except (ValueError, OverflowError):
        return None
    if len(ident) and ident.min() < 0:
        return None
    return _all_valid(lab, ident, value, nfeat, F)


def _all_valid(lab: np.ndarray, ident: np.ndarray, value: np.ndarray, nfeat: np.ndarray, F: int) -> LibfmRows:
    """A chunk whose lines are all valid: ``lab`` [n] labels as read, ``ident``/``value`` [m] the features
    of all lines in order, ``nfeat`` [n] features per line -> `LibfmRows` of width ``F``."""
    n = len(nfeat)
    row = np.repeat(np.arange(n), nfeat)
    col = np.arange(len(ident)) - np.repeat(np.cumsum(nfeat) - nfeat, nfeat)
    ids = np.zeros((n, F), dtype=np.int64)
    vals = np.zeros((n, F), dtype=np.float32)
    known = np.zeros((n, F), dtype=bool)
    ids[row, col] = ident
    vals[row, col] = value
    known[row, col] = True
    return LibfmRows((lab > 0).astype(np.float32), ids, vals, known, list(range(n)))


def _parse_checked(lines: list[str], F: int | None, has_label: bool) -> LibfmRows:
    width = F if F is not None else max((len(ln.split()) for ln in lines), default=0)
    errors: dict[int, str] = {}
    good: list[int] = []
    labels: list[float] = []
    ids = np.zeros((len(lines), width), dtype=np.int64)
    vals = np.zeros((len(lines), width), dtype=np.float32)
    known = np.zeros((len(lines), width), dtype=bool)
    n = 0
    for i, line in enumerate(lines):
        parts = line.split()
        if not parts:
            errors[i] = "empty line"
            continue
        try:
            if has_label:
                lab = float(parts[0])
                if lab not in (1.0, 0.0, -1.0):
                    raise ValueError(f"label must be 1, 0 or -1, got {parts[0][:20]!r}")
                feats = parts[1:]
            else:
                feats = parts
            if F is not None and len(feats) > F:
                raise ValueError(f"{len(feats)} features, the model has {F} fields")
            for k, tok in enumerate(feats):
                a, sep, b = tok.partition(":")
                if not sep:
                    raise ValueError(f"feature {tok[:20]!r} is not id:value")
                ident = int(a)
                if ident < 0:
                    raise ValueError(f"negative feature id {ident}")
                ids[n, k] = ident
                vals[n, k] = float(b)
                known[n, k] = True
        except ValueError as e:
            msg = str(e)
            errors[i] = (
                msg if " " in msg and "invalid literal" not in msg else f"bad number in {line.strip()[:40]!r}"
            )
            ids[n] = 0
            known[n] = False
            vals[n] = 0
            continue
        labels.append(1.0 if (has_label and lab > 0) else 0.0)
        good.append(i)
        n += 1
    if F is None:  # as wide as the widest valid line
        width = int(known[:n].sum(1).max()) if n else 0
    return LibfmRows(
        np.asarray(labels, dtype=np.float32),
        ids[:n, :width].copy(),
        vals[:n, :width].copy(),
        known[:n, :width].copy(),
        good,
        errors,
    )


def block_lines(block: bytes) -> list[str]:
    """A block of whole lines (`mariana.platform.data.textblocks`) as text lines, for the per-line
    parsers; bytes that are not UTF-8 become U+FFFD, as when the file is read as text."""
    return block.decode("utf-8", errors="replace").split("\n")[
        : block.count(b"\n") + (not block.endswith(b"\n"))
    ]


def parse_block(block: bytes, num_fields: int | None = None, has_label: bool = True) -> LibfmRows:
    """`parse_lines` of a block of whole lines, with Arrow's string kernels when every line of the block
    is valid ASCII libFM (no Python object per token); otherwise exactly `parse_lines`."""
    fast = _parse_arrow(block, num_fields, has_label) if block.isascii() else None
    return fast if fast is not None else parse_lines(block_lines(block), num_fields, has_label)


def _parse_arrow(block: bytes, F: int | None, has_label: bool) -> LibfmRows | None:
    import pyarrow as pa
    import pyarrow.compute as pc

    toks = pc.ascii_split_whitespace(pc.ascii_trim_whitespace(lines_array(block)))
    lens = pc.list_value_length(toks).to_numpy()
    n = len(lens)
    nfeat = lens - 1 if has_label else lens
    if n == 0 or lens.min() < 1 or (F is not None and nfeat.max() > F):
        return None
    if F is None:
        F = int(nfeat.max())
    flat = pc.list_flatten(toks)
    starts = toks.offsets.to_numpy()[:-1].astype(np.int64)
    try:
        if has_label:
            lab = pc.cast(flat.take(pa.array(starts)), pa.float64()).to_numpy()
            if not np.isin(lab, (1.0, 0.0, -1.0)).all():
                return None
            is_feat = np.ones(len(flat), dtype=bool)
            is_feat[starts] = False
            feats = flat.filter(pa.array(is_feat))
        else:
            lab = np.zeros(n)
            feats = flat
        kv = pc.split_pattern(feats, ":")
        if len(feats) and (pc.list_value_length(kv).to_numpy() != 2).any():  # no ':' or several
            return None
        pairs = pc.list_flatten(kv)
        m = len(feats)
        id_tok = pairs.take(pa.array(np.arange(0, 2 * m, 2)))
        # only plain digits: what Python's int() and Arrow's cast read the same way
        if m and not pc.all(pc.match_substring_regex(id_tok, r"^[0-9]+$")).as_py():
            return None
        ident = pc.cast(id_tok, pa.int64()).to_numpy()
        # through float64 as Python's float() does, then float32 like the per-line parsers
        value = pc.cast(pairs.take(pa.array(np.arange(1, 2 * m, 2))), pa.float64()).to_numpy()
        value = value.astype(np.float32)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    return _all_valid(lab, ident, value, nfeat, F)


def probe_fields(lines: list[list[int]]) -> tuple[tuple[int, ...], bool] | None:
    """What a libFM file's first lines say about its fields, from each valid line's feature ids (sorted):
    ``(starts, exact)`` when the k-th ids of all lines fall in disjoint ranges rising with k (ids
    numbered per field, like Frappe's), so that an id names its field: field k holds the ids from
    ``starts[k]`` (halfway between field k-1's largest and field k's smallest probed id) up to
    ``starts[k+1]``; ``exact``: every probed line has every field. None when the ids do not say it (one
    field, ids shared across positions): the k-th token is then field k."""
    width = max(map(len, lines), default=0)
    if width < 2:
        return None
    lo, hi = [None] * width, [None] * width
    for ids in lines:
        for k, i in enumerate(ids):
            lo[k] = i if lo[k] is None else min(lo[k], i)
            hi[k] = i if hi[k] is None else max(hi[k], i)
    if any(v is None for v in lo) or any(hi[k] >= lo[k + 1] for k in range(width - 1)):
        return None
    starts = (0, *((hi[k - 1] + lo[k] + 1) // 2 for k in range(1, width)))
    return starts, all(len(ids) == width for ids in lines)


def assign_fields(p: LibfmRows, starts: tuple[int, ...], exact: bool) -> LibfmRows:
    """``p`` with each id moved to the field its value names (`probe_fields`), whatever the order of the
    tokens in its line; a line with two ids of one field, or (``exact``) without every field, is moved
    to ``errors``. ``p``'s arrays must be ``len(starts)`` wide."""
    F = len(starts)
    if len(p) == 0 or p.ids.shape[1] != F:
        return p
    field = np.searchsorted(np.asarray(starts, dtype=np.int64), p.ids, side="right") - 1
    in_place = (field == np.arange(F)[None, :]) | ~p.known
    # A full line whose ids rise token by token is in field order already: it keeps its positions even
    # where an id lies past a boundary the probe estimated from the first lines (Frappe's user ids overlap
    # the probe's guess of where item ids start).
    ordered = p.known.all(1) & (np.diff(p.ids, axis=1) > 0).all(1)
    ok_rows = (in_place.all(1) | ordered) & (p.known.all(1) if exact else True)
    if ok_rows.all():
        return p
    ids, vals, known = np.zeros_like(p.ids), np.zeros_like(p.vals), np.zeros_like(p.known)
    keep, errors = [], dict(p.errors)
    for r in range(len(p)):
        ks = np.flatnonzero(p.known[r])
        fs = field[r, ks]
        if ordered[r]:
            ids[r], vals[r], known[r] = p.ids[r], p.vals[r], p.known[r]
            keep.append(r)
        elif exact and len(ks) != F:
            errors[p.good[r]] = f"{len(ks)} features, expected one of each of the {F} fields of training"
        elif len(set(fs.tolist())) != len(fs):
            dup = next(f for f in fs.tolist() if (fs == f).sum() > 1)
            errors[p.good[r]] = f"two features of field {dup} (its ids start at {starts[dup]})"
        else:
            ids[r, fs], vals[r, fs], known[r, fs] = p.ids[r, ks], p.vals[r, ks], True
            keep.append(r)
    k = np.asarray(keep, dtype=np.int64)
    return LibfmRows(p.labels[k], ids[k], vals[k], known[k], [p.good[r] for r in keep], errors)
