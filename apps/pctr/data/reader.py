"""pCTR's input as one object: a ``--data`` source resolved, counted, checked, split and encoded once.

`ClickSource` is made once per process from a run's data section (`ClickSource.from_sections`) or, to
score an exported model, from a data value and that model's encoder. It holds the files
(`data.sources.DataSources`), the `Schema` (inferred once) and its one `Encoder`, the line count (taken
the first time a split needs it: servers and streams never count), the splits
(`mariana.platform.data.splits.split_bounds`) and a worker's contiguous share of the training split
(`shard_lines`, `worker_data`), the encoded rows of any line range (`chunks`, `load`) and the validation
set (`val_set`). The one-process trainer, the parameter-server workers, ``pctr eval`` and the streams read
through it; `WorkerData` is a worker's share in batches, cached encoded after the first pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

import numpy as np
from mariana.platform.core.errors import DataError
from mariana.platform.data.shards import BatchStore, host_budget_gb
from mariana.platform.data.splits import split_bounds
from mariana.platform.ps.shard import contiguous_part

from ..configs import parse_split
from .encoding import Batch, Encoder, ReadStats, infer_schema, iter_batches, iter_chunks, load_split
from .sources import DataSources, resolve_sources

log = logging.getLogger("mariana")
ALL_ROWS = (1.0, 0.0, 0.0)  # the split of a source read whole (no validation or test rows)


def shard_lines(start: int, stop: int, worker: int, num_workers: int) -> tuple[int, int]:
    """Worker ``worker`` of ``num_workers``'s contiguous part ``[lo, hi)`` of lines ``[start, stop)``:
    the parts are disjoint, cover the range, and differ in length by at most one line."""
    lo, hi = contiguous_part(stop - start, worker, num_workers)
    return start + lo, start + hi


def encoding_key(encoder: Encoder) -> dict:
    """What turns lines into rows (the schema; with --image-features the CNN and the fitted projection):
    part of the fingerprint of cached rows, so a changed encoding never reads rows of the old one."""
    image = None
    if encoder.image is not None:
        img = encoder.image
        proj = [t.detach().cpu().numpy().tobytes() for t in (img.proj_mean, img.proj) if t is not None]
        image = {**img.meta(), "projection": hashlib.sha256(b"".join(proj)).hexdigest()}
    return {"schema": encoder.schema.to_dict(), "image": image}


class ClickSource:
    """One ``--data`` source read with one encoder (see the module docstring).

    ``data``: a path, a comma-separated list, a folder, a list of paths or a resolved `DataSources`;
    ``encoder``: what turns its lines into `Batch`es; ``fractions``: (train, val, test) of its lines."""

    def __init__(
        self,
        data: str | Path | DataSources,
        encoder: Encoder,
        fractions: tuple[float, float, float] = ALL_ROWS,
    ):
        self.sources = resolve_sources(data)
        self.encoder, self.fractions = encoder, fractions

    @classmethod
    def from_sections(cls, input, rows, data: str | Path | DataSources | None = None) -> ClickSource:
        """The source of a run's ``input`` section (`PctrData`; or a stream's, which has no ``split``: its
        files are read whole) with the ``rows`` section (`Ids`: rows per field, hashed or dynamic ids);
        ``data``: its ``--data`` already resolved (or another value to read with the run's settings)."""
        sources = resolve_sources(input.data if data is None else data)
        schema = infer_schema(sources, input.format, rows.rows_per_field, input.num_fields)
        schema.ids = rows.ids  # "dynamic": the encoder emits keys (`ids.idmap.key_of`)
        return cls(sources, Encoder(schema), parse_split(getattr(input, "split", "1,0,0")))

    def __str__(self) -> str:
        return str(self.sources)

    @property
    def schema(self):
        return self.encoder.schema

    @cached_property
    def lines(self) -> int:
        """The source's number of lines (every file counted once, the first time a split needs it)."""
        return self.sources.lines()

    @cached_property
    def bounds(self) -> dict[str, tuple[int, int]]:
        """Line ranges ``[start, stop)`` of the splits ('train', 'val', 'test', 'all'), by row order."""
        return split_bounds(self.lines, self.fractions)

    def chunks(
        self, start: int = 0, stop: int | None = None, stats: ReadStats | None = None, chunk: int = 65536
    ) -> Iterator[Batch]:
        """Encoded chunks (at most ``chunk`` rows) of lines ``[start, stop)`` in order (`encoding.iter_chunks`);
        skipped lines go to ``stats``."""
        return iter_chunks(self.sources, self.encoder, start, stop, chunk=chunk, stats=stats)

    def load(self, start: int, stop: int | None, stats: ReadStats | None = None) -> Batch:
        """Lines ``[start, stop)`` encoded as one `Batch` in memory (small splits)."""
        return load_split(self.sources, self.encoder, start, stop, stats=stats)

    def val_set(
        self, device, max_rows: int = 0, batch: int = 8192
    ) -> tuple[list[Batch], np.ndarray, ReadStats]:
        """The validation split (its first ``max_rows`` lines when > 0) on ``device`` in batches of
        ``batch`` rows, its labels float32 [n], and the split's read statistics."""
        a, b = self.bounds["val"]
        if max_rows:
            b = min(b, a + max_rows)
        stats = ReadStats()
        val = self.load(a, b, stats)
        return (
            [val.slice(i, i + batch).to(device) for i in range(0, len(val), batch)],
            val.labels.numpy(),
            stats,
        )

    def worker_data(self, batch_size: int, worker: int = 0, num_workers: int = 1, **kw) -> WorkerData:
        """Worker ``worker`` of ``num_workers``'s share of the training split (`WorkerData`; ``kw``: its
        seed, shuffle and cache settings)."""
        a, b = self.bounds["train"]
        return WorkerData(self, self.encoder, a, b, batch_size, worker, num_workers, **kw)


class WorkerData:
    """Worker ``w`` of ``W``'s share of the training rows ``[start, stop)`` in batches of ``batch_size``.

    ``path``: a `ClickSource` (``encoder`` then its own) or anything `ClickSource` reads. The share is a
    contiguous range of lines, the ``w``-th of ``W`` near-equal parts, so workers parse disjoint parts of
    the file (the lines before a share are only counted, never parsed). Every worker runs the same
    ``steps_per_epoch`` (what bulk-synchronous training needs); with shuffling, a share's whole batches
    beyond ``steps_per_epoch`` are cached and take turns in later epochs. ``batches(epoch, skip)`` yields
    ``steps_per_epoch`` batches; epoch 0 streams the share (and fills the cache), later epochs come from
    the cache (on ``cache_device``)."""

    def __init__(
        self,
        path,
        encoder: Encoder,
        start: int,
        stop: int,
        batch_size: int,
        worker: int = 0,
        num_workers: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        cache_device="cpu",
        cache_gb: float | None = None,
        cache_dir=None,
    ):
        self.source = path if isinstance(path, ClickSource) else ClickSource(path, encoder)
        self.encoder = self.source.encoder
        self.bs, self.w, self.W, self.seed, self.shuffle = batch_size, worker, num_workers, seed, shuffle
        self.stats = ReadStats()
        self.steps_per_epoch = max(1, ((stop - start) // batch_size) // num_workers)
        self.lo, self.hi = shard_lines(start, stop, worker, num_workers)
        # the encoded rows: on the device / in RAM up to --cache-gb, else memory-mapped shards in cache_dir
        # (reused by a resumed run when source and encoding are unchanged; `close` deletes them)
        key = {"encoding": encoding_key(self.encoder), "lines": [self.lo, self.hi], "batch": batch_size}
        self.cache = BatchStore(
            cache_dir, ("ids", "vals", "dense", "labels"), Batch, self.source.sources.paths, key,
            self.hi - self.lo, host_budget_gb(cache_gb), cache_device,
        )  # fmt: skip
        if self.cache.complete:  # a whole store from an earlier attempt of this run: its read statistics
            log.info("worker %d: %d encoded batches reused from %s", worker, len(self.cache), cache_dir)
            s = self.cache.extra["stats"]
            self.stats = ReadStats(s["rows"], s["skipped"], {int(k): v for k, v in s["errors"].items()})

    def _stream(self) -> Iterator[Batch]:
        chunks = iter_chunks(self.source.sources, self.encoder, self.lo, self.hi, stats=self.stats)
        for b in iter_batches(chunks, self.bs, drop_last=True):
            yield self.cache.append(b)
        self.cache.finish({"stats": dataclasses.asdict(self.stats)})
        if not len(self.cache):  # no batch, so no tier either: nothing to log
            raise DataError(
                f"{self.source}: no valid rows for worker {self.w} in lines {self.lo + 1}-{self.hi}"
            )
        log.info("worker %d: %d encoded batches kept (%s tier)", self.w, len(self.cache), self.cache.tier)

    def batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        n = self.steps_per_epoch
        if epoch == 0 and not self.cache.complete:
            self.cache.clear()
            k = 0
            for b in self._stream():
                if k >= n:
                    continue  # keep caching the rest of this worker's rows
                if k >= skip:
                    yield b
                k += 1
            # malformed lines may leave fewer batches than planned: top up from the cache
            while k < n:
                if k >= skip:
                    yield self.cache[k % len(self.cache)]
                k += 1
            return
        if not self.cache.complete:
            for _ in self._stream():
                pass
        m = len(self.cache)
        order = np.arange(max(n, m)) % m
        if self.shuffle and epoch > 0:  # epoch 0 from a reused store: the order streaming yields
            order = np.random.default_rng(self.seed * 1009 + epoch).permutation(order)
        for k in range(skip, n):
            yield self.cache[order[k]]

    def close(self) -> None:
        """The run is over: drop the cached rows and delete their shards (and their parent folder, once
        every worker's is gone)."""
        folder = self.cache.folder
        self.cache.close()
        if folder is not None:
            with contextlib.suppress(OSError):
                folder.parent.rmdir()
