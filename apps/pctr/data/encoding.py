"""Streaming readers for click logs: Criteo TSV and libSVM/libFM, hashed per field.

- ``criteo``: ``label \t I1..I13 \t C1..C26``: 13 bucketised counts + 26 hashed categoricals = 39 fields,
  plus the counts as dense ``log1p(max(x, 0))`` [13];
- ``libfm``: ``label id:value ...``, the k-th pair field k (parsed by `mariana.platform.data.libfm`).

Field f owns rows ``[f R, (f + 1) R)``; row ``f R`` is its missing/OOV row, a value maps to
``f R + 1 + h(value) % (R - 1)`` (``--ids dynamic``: a per-field key instead, `ids/idmap.py`). The exact
encoding is in apps/pctr/README.md (Serving, the model's inputs). Readers are generators over lines,
vectorised per chunk (memory O(chunk)); a malformed line is skipped and counted with its 1-based line
number in `ReadStats`.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from mariana.platform.core.errors import DataError
from mariana.platform.data.libfm import (
    LibfmRows,
    assign_fields,
    block_lines,
    parse_block,
    parse_lines,
    probe_fields,
)
from mariana.platform.data.textblocks import lines_array, open_data, ordered_map, read_blocks

from ..ids.idmap import MIX1, MIX2, key_of
from .sources import count_file_lines, resolve_sources

FORMATS = ("criteo", "libfm")
CRITEO_INTS, CRITEO_CATS = 13, 26


@dataclass
class Schema:
    """What the hashed rows look like: ``num_fields`` ids per row into ``num_fields * rows_per_field``
    table rows, and ``num_dense`` float features."""

    format: str
    num_fields: int
    rows_per_field: int
    num_dense: int
    ids: str = (
        "hash"  # "dynamic": `Batch.ids` hold keys (`ids.idmap.key_of`) that an `ids.idmap.IdMap` maps to rows
    )
    # libFM whose ids name their field (`libfm.probe_fields`): the first id of each field, and whether
    # training lines have every field; lines are then read by id, not by token order (`libfm.assign_fields`)
    field_starts: tuple[int, ...] | None = None
    exact_fields: bool = False

    @property
    def num_rows(self) -> int:
        return self.num_fields * self.rows_per_field

    def to_dict(self) -> dict:
        return {
            "format": self.format,
            "num_fields": self.num_fields,
            "rows_per_field": self.rows_per_field,
            "num_dense": self.num_dense,
            **({"ids": self.ids} if self.ids != "hash" else {}),
            **(
                {"field_starts": list(self.field_starts), "exact_fields": self.exact_fields}
                if self.field_starts
                else {}
            ),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Schema:
        return cls(
            d["format"],
            int(d["num_fields"]),
            int(d["rows_per_field"]),
            int(d["num_dense"]),
            d.get("ids", "hash"),
            tuple(int(x) for x in d["field_starts"]) if d.get("field_starts") else None,
            bool(d.get("exact_fields", False)),
        )


@dataclass
class Batch:
    """``ids`` int64 [B, F] table rows; ``vals`` float32 [B, F]; ``dense`` float32 [B, D];
    ``labels`` float32 [B] in {0, 1} (zeros when parsing unlabelled records)."""

    ids: torch.Tensor
    vals: torch.Tensor
    dense: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.ids.shape[0]

    def to(self, device) -> Batch:
        nb = torch.device(device).type == "cuda"
        return Batch(*(t.to(device, non_blocking=nb) for t in (self.ids, self.vals, self.dense, self.labels)))

    def slice(self, a: int, b: int) -> Batch:
        return Batch(self.ids[a:b], self.vals[a:b], self.dense[a:b], self.labels[a:b])

    @staticmethod
    def cat(batches: list[Batch]) -> Batch:
        return Batch(
            *(torch.cat([getattr(b, k) for b in batches]) for k in ("ids", "vals", "dense", "labels"))
        )


@dataclass
class ReadStats:
    rows: int = 0
    skipped: int = 0
    errors: dict[int, str] = field(default_factory=dict)  # line number -> message (first `keep`)
    keep: int = 100

    def bad(self, lineno: int, msg: str) -> None:
        self.skipped += 1
        if len(self.errors) < self.keep:
            self.errors[lineno] = msg


def _mix(x: np.ndarray, salt: np.ndarray) -> np.ndarray:
    """splitmix64-style mix of uint64 values with a per-field salt (deterministic across processes)."""
    with np.errstate(over="ignore"):
        z = (x + salt * MIX1) * MIX2
        z ^= z >> np.uint64(31)
        z *= MIX1
        z ^= z >> np.uint64(29)
    return z


def _crc(tokens: np.ndarray) -> np.ndarray:
    """CRC32 of each distinct string (hashing only the unique ones: power-law data repeats a lot)."""
    uniq, inv = np.unique(tokens, return_inverse=True)
    h = np.fromiter((zlib.crc32(t.encode()) for t in uniq), dtype=np.uint64, count=len(uniq))
    return h[inv.reshape(-1)].reshape(tokens.shape)


class Encoder:
    """Turns text records into `Batch`es for one `Schema` (vectorised over a chunk of lines)."""

    def __init__(self, schema: Schema):
        self.schema = schema
        if schema.format not in FORMATS:
            raise DataError(f"unknown format {schema.format!r}; expected one of {', '.join(FORMATS)}")
        R = schema.rows_per_field
        self.base = torch.arange(schema.num_fields, dtype=torch.int64) * R
        # `--image-features`: an `images.features.ImageFeatures` that appends the CNN features of the image a field
        # names to ``Batch.dense`` and moves rows whose image fails to the errors (set by its setup)
        self.image = None
        # fields parsed from the record; `--image-cross` appends its fields after them (schema.num_fields)
        self.parsed_fields = schema.num_fields

    # ---------------------------------------------------------------- per-format parsing
    def encode(
        self, lines: list[str], has_label: bool = True, first_lineno: int = 1, stats: ReadStats | None = None
    ) -> tuple[Batch, list[int], dict[int, str]]:
        """Parse ``lines``. Returns (batch of the valid lines, their indices in ``lines``, index -> error)."""
        if self.schema.format == "criteo":
            out = self._criteo(lines, has_label)
        else:
            out = self._libfm(parse_lines(lines, self.parsed_fields, has_label))
        if self.image is not None:
            out = self.image.apply(out, lines, has_label)
        _count(stats, out, first_lineno)
        return out

    def encode_block(self, block: bytes, has_label: bool = True) -> tuple[Batch, list[int], dict[int, str]]:
        """`encode` of a block of whole lines (`mariana.platform.data.textblocks`): Arrow's kernels when
        every line is ASCII and its numbers plain, else the per-line parser; the results are the same."""
        out = self._encode_block(block, has_label)
        if self.image is not None:
            out = self.image.apply(out, block_lines(block), has_label)
        return out

    def _encode_block(self, block: bytes, has_label: bool) -> tuple[Batch, list[int], dict[int, str]]:
        if self.schema.format == "libfm":
            return self._libfm(parse_block(block, self.parsed_fields, has_label))
        fast = self._criteo_arrow(block, has_label) if block.isascii() else None
        return fast if fast is not None else self._criteo(block_lines(block), has_label)

    def _finish(self, raw: np.ndarray, known: np.ndarray) -> torch.Tensor:
        """raw uint64 [n, F] values (already hashed or small ints), known bool [n, F] -> rows [n, F]; with
        ``ids == "dynamic"`` keys [n, F] instead (`ids.idmap.key_of`; -1 missing), mapped to rows by the step."""
        if self.schema.ids == "dynamic":
            return torch.from_numpy(key_of(raw, known))
        R = self.schema.rows_per_field
        local = (raw % np.uint64(R - 1)).astype(np.int64) + 1
        local[~known] = 0
        return torch.from_numpy(local) + self.base[: local.shape[1]]

    def _criteo(self, lines, has_label):
        off = 1 if has_label else 0
        want = off + CRITEO_INTS + CRITEO_CATS
        errors: dict[int, str] = {}
        good_idx, rows = [], []
        for i, line in enumerate(lines):
            parts = line.rstrip("\r\n").split("\t")
            # Trailing empty fields are often stripped from copies of the log: pad them as missing.
            if len(parts) > want or len(parts) < off + CRITEO_INTS + 1:
                errors[i] = f"expected {want} tab-separated fields, got {len(parts)}"
                continue
            if len(parts) < want:
                parts += [""] * (want - len(parts))
            if has_label and parts[0] not in ("0", "1"):
                errors[i] = f"label must be 0 or 1, got {parts[0][:20]!r}"
                continue
            rows.append(parts)
            good_idx.append(i)
        labels = np.zeros(len(rows), dtype=np.float32)
        ints = np.zeros((len(rows), CRITEO_INTS), dtype=np.int64)
        int_known = np.zeros((len(rows), CRITEO_INTS), dtype=bool)
        keep = np.ones(len(rows), dtype=bool)
        if rows:
            arr = np.array(rows, dtype=object)
            if has_label:
                labels = (arr[:, 0] == "1").astype(np.float32)
            int_tok = arr[:, off : off + CRITEO_INTS]
            int_tok = int_tok.astype(str)
            int_known = int_tok != ""
            try:  # one numpy conversion for the whole chunk
                ints = np.where(int_known, int_tok, "0").astype(np.int64)
            except (ValueError, OverflowError):  # find the bad lines: a bad count invalidates only its line
                for j in range(len(rows)):
                    try:
                        ints[j] = [int(t) if t else 0 for t in int_tok[j]]
                    except ValueError:
                        bad = next(t for t in int_tok[j] if t and not t.lstrip("-").isdigit())
                        errors[good_idx[j]] = f"integer feature is not an integer: {bad[:20]!r}"
                        keep[j] = False
            cats = arr[:, off + CRITEO_INTS :].astype(str)
        else:
            cats = np.zeros((0, CRITEO_CATS), dtype=str)
        ints, int_known, labels, cats = ints[keep], int_known[keep], labels[keep], cats[keep]
        good_idx = [g for g, k in zip(good_idx, keep) if k]
        cat_hash = _crc(cats) if len(cats) else np.zeros((0, CRITEO_CATS), np.uint64)
        return self._criteo_batch(labels, ints, int_known, cat_hash, cats != ""), good_idx, errors

    def _criteo_arrow(self, block: bytes, has_label: bool) -> tuple[Batch, list[int], dict[int, str]] | None:
        """`_criteo` with Arrow's string kernels (same rows, ids and errors); None when a count is not
        plain digits (the per-line parser then names the line)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        off = 1 if has_label else 0
        want = off + CRITEO_INTS + CRITEO_CATS
        parts = pc.split_pattern(pc.ascii_rtrim(lines_array(block), characters="\r\n"), "\t")
        lens = pc.list_value_length(parts).to_numpy()
        flat = pc.list_flatten(parts)
        starts = parts.offsets.to_numpy()[:-1].astype(np.int64)
        ok = (lens <= want) & (lens >= off + CRITEO_INTS + 1)
        errors = {int(i): f"expected {want} tab-separated fields, got {lens[i]}" for i in np.flatnonzero(~ok)}
        labels = np.zeros(len(lens), dtype=np.float32)
        if has_label:
            lab = flat.take(pa.array(starts))
            is01 = pc.is_in(lab, value_set=pa.array(["0", "1"])).to_numpy(zero_copy_only=False)
            bad = np.flatnonzero(ok & ~is01)
            for i, tok in zip(bad, lab.take(pa.array(bad)).to_pylist()):
                errors[int(i)] = f"label must be 0 or 1, got {tok[:20]!r}"
            ok &= is01
            labels = pc.equal(lab, "1").to_numpy(zero_copy_only=False).astype(np.float32)
        rows = np.flatnonzero(ok)
        n = len(rows)
        k = np.arange(off, want)
        idx = starts[rows, None] + k
        present = k[None, :] < lens[rows, None]  # stripped trailing fields are missing
        tok = flat.take(pa.array(idx.ravel(), mask=~present.ravel()))
        known = pc.fill_null(pc.not_equal(tok, ""), False).to_numpy(zero_copy_only=False).reshape(n, len(k))
        cols = np.arange(known.size).reshape(n, len(k))
        int_known, cat_known = known[:, :CRITEO_INTS], known[:, CRITEO_INTS:]
        int_tok = tok.take(pa.array(cols[:, :CRITEO_INTS][int_known]))
        if len(int_tok) and not pc.all(pc.match_substring_regex(int_tok, r"^-?[0-9]+$")).as_py():
            return None
        ints = np.zeros((n, CRITEO_INTS), dtype=np.int64)
        try:
            ints[int_known] = pc.cast(int_tok, pa.int64()).to_numpy()
        except pa.ArrowInvalid:  # out of int64's range
            return None
        codes = pc.dictionary_encode(tok.take(pa.array(cols[:, CRITEO_INTS:].ravel())))
        # CRC32 of each distinct string, as `_crc` does (what was missing is masked by cat_known)
        uniq = codes.dictionary.cast(pa.binary()).to_pylist()
        h = np.fromiter(map(zlib.crc32, uniq), dtype=np.uint64, count=len(uniq))
        cat_hash = h[pc.fill_null(codes.indices, 0).to_numpy()].reshape(n, CRITEO_CATS)
        batch = self._criteo_batch(labels[rows], ints, int_known, cat_hash, cat_known)
        return batch, rows.tolist(), dict(sorted(errors.items()))

    def _criteo_batch(self, labels, ints, int_known, cat_hash, cat_known) -> Batch:
        """Parsed Criteo rows -> `Batch`: ``labels`` [n], ``ints`` int64 [n, 13] (0 where missing),
        ``cat_hash`` uint64 [n, 26] CRC32 of each categorical string, ``*_known`` bool masks."""
        pos = np.maximum(ints, 0).astype(np.float64)
        dense = np.log1p(pos).astype(np.float32)
        # log^2 bucketing of counts > 2 (negative values get their own small buckets)
        bucket = np.where(
            ints > 2, np.floor(np.log(np.maximum(pos, 1.0)) ** 2).astype(np.int64) + 3, ints + 3
        )
        raw_int = bucket.astype(np.uint64)
        salt = np.arange(CRITEO_CATS, dtype=np.uint64)[None, :] + np.uint64(1)
        raw_cat = _mix(cat_hash, salt)
        ids = self._finish(np.concatenate([raw_int, raw_cat], 1), np.concatenate([int_known, cat_known], 1))
        n = len(labels)
        return Batch(ids, torch.ones(n, ids.shape[1]), torch.from_numpy(dense), torch.from_numpy(labels))

    def _libfm(self, p: LibfmRows) -> tuple[Batch, list[int], dict[int, str]]:
        """Rows of the platform's one libFM parser (`mariana.platform.data.libfm`) -> `Batch`."""
        if self.schema.field_starts:
            p = assign_fields(p, self.schema.field_starts, self.schema.exact_fields)
        n = len(p)
        rows = self._finish(p.ids.astype(np.uint64), p.known)
        batch = Batch(rows, torch.from_numpy(p.vals), torch.zeros(n, 0), torch.from_numpy(p.labels))
        return batch, p.good, p.errors


def _count(stats: ReadStats | None, encoded: tuple[Batch, list[int], dict[int, str]], first: int) -> None:
    """Add an encoded chunk's rows and skipped lines (``first``: the chunk's first 1-based line number)."""
    if stats is not None:
        stats.rows += len(encoded[0])
        for i, msg in encoded[2].items():
            stats.bad(first + i, msg)


def count_lines(path) -> int:
    """Number of lines of ``path``: a file, a comma-separated list of files or a folder of partitions
    (`data.sources.resolve_sources`; their lines one after the other). Streaming, 1 MiB blocks."""
    src = resolve_sources(path)
    return count_file_lines(src.paths[0]) if src.single else src.lines()


def infer_schema(
    path: str | Path, fmt: str, rows_per_field: int, num_fields: int = 0, probe: int = 1000
) -> Schema:
    """Criteo has a fixed layout; for libFM the number of fields is the most features seen in the first
    ``probe`` valid lines unless ``num_fields`` is given."""
    if fmt == "criteo":
        return Schema("criteo", CRITEO_INTS + CRITEO_CATS, rows_per_field, CRITEO_INTS)
    if fmt != "libfm":
        raise DataError(f"unknown --format {fmt!r}; expected criteo or libfm")
    if num_fields > 0:
        return Schema("libfm", num_fields, rows_per_field, 0)
    probed, sources = [], resolve_sources(path)
    sources.check_not_empty()
    with io.TextIOWrapper(open_data(sources.paths[0]), encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 1 and all(":" in p for p in parts[1:]):
                try:
                    probed.append(sorted(int(p.split(":", 1)[0]) for p in parts[1:]))  # any token order
                except ValueError:
                    continue
            if len(probed) >= probe:
                break
    if not probed:
        raise DataError(f"{path}: no valid libFM line ('label id:value ...') in the first lines")
    fields = probe_fields(probed)
    starts, exact = fields if fields else (None, False)
    return Schema("libfm", max(map(len, probed)), rows_per_field, 0, "hash", starts, exact)


def iter_chunks(
    path: str | Path,
    encoder: Encoder,
    start: int = 0,
    stop: int | None = None,
    chunk: int = 65536,
    stats: ReadStats | None = None,
    has_label: bool = True,
    threads: int = 0,
) -> Iterator[Batch]:
    """Stream the lines ``[start, stop)`` (0-based, in file order) of ``path`` as encoded chunks of at most
    ``chunk`` lines, parsed on ``threads`` threads in file order (0: as many as torch's intra-op threads,
    the process's CPU budget; one per core by default, one per process under a multi-process launcher).

    ``path``: a file, a comma-separated list of files or a folder of partitions (`data/sources.py`); line
    numbers are those of the files' concatenation, a chunk never spans two files, and with several files
    a skipped line's message starts with its file and line in that file (``stats`` keys stay global)."""
    src = resolve_sources(path)
    pieces = [(0, src.paths[0], start, stop)] if src.single else src.ranges(start, stop)
    threads = threads or torch.get_num_threads()

    def blocks():
        for off, p, lo, hi in pieces:
            for first, block in read_blocks(p, lo, hi, max_lines=chunk):
                yield off + first, off, p, block

    def encode(item):
        first, off, p, block = item
        return first, off, p, encoder.encode_block(block, has_label)

    for first, off, p, out in ordered_map(encode, blocks(), threads):
        if not src.single and out[2]:
            local = first - off + 1
            out = (out[0], out[1], {i: f"{p} line {local + i}: {m}" for i, m in out[2].items()})
        _count(stats, out, first + 1)
        if len(out[0]):
            yield out[0]


def iter_batches(chunks: Iterator[Batch], batch_size: int, drop_last: bool = False) -> Iterator[Batch]:
    """Re-cut a stream of chunks into batches of exactly ``batch_size`` rows (the last may be short)."""
    pending: list[Batch] = []
    have = 0
    for c in chunks:
        pending.append(c)
        have += len(c)
        if have >= batch_size:
            cat = Batch.cat(pending)
            n_full = len(cat) // batch_size
            for k in range(n_full):
                yield cat.slice(k * batch_size, (k + 1) * batch_size)
            rest = cat.slice(n_full * batch_size, len(cat))
            pending, have = ([rest], len(rest)) if len(rest) else ([], 0)
    if have and not drop_last:
        yield Batch.cat(pending)


def load_split(path, encoder: Encoder, start: int, stop: int | None, stats: ReadStats | None = None) -> Batch:
    """Whole split in memory (for evaluation of small splits and the in-memory cache)."""
    chunks = list(iter_chunks(path, encoder, start, stop, stats=stats))
    if not chunks:
        F, D = encoder.schema.num_fields, encoder.schema.num_dense
        return Batch(
            torch.zeros(0, F, dtype=torch.int64), torch.zeros(0, F), torch.zeros(0, D), torch.zeros(0)
        )
    return Batch.cat(chunks)
