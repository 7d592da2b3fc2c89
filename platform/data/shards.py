"""Encoded batches beyond a memory budget: binary shards on disk, written once, read back memory-mapped.

A `BatchStore` holds the batches of one pass over a data set, each a record of tensors with one leading
size (pCTR's `Batch`: ids [B, F] int64, vals [B, F], dense [B, D], labels [B] float32), where the shared
tier rule (`choose_tier`, ``--cache-gb``) puts them: ``device`` / ``host`` (a
list of batches) or ``disk`` (``FOLDER/shard-NNNNN.bin`` of about ``shard_bytes`` each, fields 64-byte
aligned, mapped back copy-on-write so resident memory stays O(batches in flight)).

Trust: a store is reused only when its index's fingerprint (the source files and the caller's encoding key)
matches and every shard has its recorded size, else rebuilt, so a killed run or a changed file never serves
stale rows. Writes, layout and lifetime: apps/pctr/README.md, "Data larger than memory".

The tier rule, one for every app's working set (feature cache, decoded images, encoded rows): ``device``
when it fits in a share of the training device's free memory (a GPU; on the CPU the device is host RAM, so
the ``--cache-gb`` limit applies), then ``host`` RAM up to ``--cache-gb`` gigabytes, then ``disk``.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mariana.platform.core.atomic import atomic_write_text

DEVICE_SHARE = 0.25  # of the GPU's free memory: the rest is for the model, activations and the allocator
# of physical RAM: the --cache-gb of an app that leaves it unset (the rest: model, OS, others)
RAM_SHARE = 0.25


def host_budget_gb(cache_gb: float | None) -> float:
    """``cache_gb``, or when it is None a quarter of this machine's physical RAM, in GB (1e9 bytes)."""
    if cache_gb is not None:
        return cache_gb
    return RAM_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def choose_tier(nbytes: int, device: torch.device, cache_gb: float, free_device: int | None = None) -> str:
    """``"device"``, ``"host"`` or ``"disk"`` for a working set of ``nbytes`` bytes trained on ``device``.

    ``cache_gb``: the most host RAM the set may take (0: never in RAM); ``free_device``: the GPU's free bytes
    (default: asked from CUDA)."""
    limit = int(cache_gb * 1e9)
    if device.type == "cuda":
        if free_device is None:
            free_device = torch.cuda.mem_get_info(device)[0]
        if nbytes <= DEVICE_SHARE * free_device:
            return "device"
        return "host" if nbytes <= limit else "disk"
    return "device" if nbytes <= limit else "disk"  # a CPU's device memory is its RAM


FORMAT = 1  # of index.json and the shard layout; a store of another format is rebuilt
ALIGN = 64  # bytes: every field starts aligned (numpy / torch views need at least the item size)
HASH_BYTES = 1 << 20  # of each source file's head and tail in the fingerprint
SHARD_BYTES = 256 << 20


def source_fingerprint(paths: Sequence[str | os.PathLike], key: Any) -> str:
    """SHA-256 (hex) of the files ``paths`` (each one's path, size, mtime in ns, first and last MiB) and
    ``key`` (any JSON-able value: what turns the files into batches, e.g. the schema and line range)."""
    h = hashlib.sha256(json.dumps([FORMAT, key], sort_keys=True, default=str).encode())
    for p in paths:
        st = os.stat(p)
        h.update(f"{Path(p).resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(p, "rb") as f:
            h.update(f.read(HASH_BYTES))
            if st.st_size > HASH_BYTES:
                f.seek(max(HASH_BYTES, st.st_size - HASH_BYTES))
                h.update(f.read(HASH_BYTES))
    return h.hexdigest()


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _map(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """Bytes ``[offset, offset + nbytes)`` of ``path`` as a uint8 array viewing a private (copy-on-write)
    mapping, its pages read in at once (MAP_POPULATE where the OS has it: one call instead of a page fault
    per 4 KiB). The mapping ends when the last array viewing it is dropped."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
    with open(path, "rb") as f:
        m = mmap.mmap(
            f.fileno(), offset - start + nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE, offset=start
        )
    return np.frombuffer(m, np.uint8, nbytes, offset - start)


class _ShardWriter:
    """Appends batches to ``folder/shard-NNNNN.bin.tmp``, renaming each shard once it reaches
    ``shard_bytes``; ``entries``: (shard, offset, rows) per batch written."""

    def __init__(self, folder: Path, shard_bytes: int):
        self.folder, self.shard_bytes = folder, shard_bytes
        self.entries: list[tuple[int, int, int]] = []
        self.sizes: list[int] = []  # of the renamed shards
        self.f = None
        self.offset = 0

    def write(self, tensors: Sequence[torch.Tensor]) -> None:
        if self.f is None:
            self.f = open(self.folder / f"shard-{len(self.sizes):05d}.bin.tmp", "wb")
            self.offset = 0
        self.entries.append((len(self.sizes), self.offset, int(tensors[0].shape[0])))
        for t in tensors:
            a = t.detach().cpu().contiguous().numpy()
            if a.nbytes:  # (a field of width 0, e.g. libFM's dense [B, 0], has no bytes to write)
                self.f.write(memoryview(a).cast("B"))  # no copy of the batch's bytes
            pad = _padded(a.nbytes) - a.nbytes
            self.f.write(b"\0" * pad)
            self.offset += a.nbytes + pad
        if self.offset >= self.shard_bytes:
            self.close_shard()

    def close_shard(self) -> None:
        if self.f is None:
            return
        self.f.close()
        name = self.folder / f"shard-{len(self.sizes):05d}.bin"
        os.replace(f"{name}.tmp", name)
        self.sizes.append(self.offset)
        self.f = None

    def abort(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


class BatchStore:
    """The batches of one pass, in the tier ``choose_tier`` picks; see the module's docstring.

    ``fields``: the names of a batch's tensors (read with ``getattr``); ``make(*tensors)`` rebuilds a batch
    from them. ``folder``: where the disk tier's shards go (created on demand; None: a new temporary
    folder, never reused). ``sources`` / ``key``: what the fingerprint covers. ``expected_rows``: the rows
    the pass will hold at most (sizes the tier); ``cache_gb``: the host-RAM budget in GB; ``device``: the
    training device (the ``device`` tier's). A whole store of the same fingerprint found in ``folder`` is
    reused as it is (tier ``disk``, ``complete``), whatever the budget now."""

    def __init__(
        self,
        folder: str | os.PathLike | None,
        fields: Sequence[str],
        make: Callable[..., Any],
        sources: Sequence[str | os.PathLike],
        key: Any,
        expected_rows: int,
        cache_gb: float,
        device: torch.device | str = "cpu",
        shard_bytes: int = SHARD_BYTES,
    ):
        self.folder = Path(folder) if folder is not None else None
        self.fields, self.make = tuple(fields), make
        self.fingerprint = source_fingerprint(sources, key)
        self.expected_rows, self.cache_gb = expected_rows, cache_gb
        self.device, self.shard_bytes = torch.device(device), shard_bytes
        self.tier: str | None = None
        self.complete = False
        self.extra: dict = {}
        self._mem: list[Any] = []
        self._writer: _ShardWriter | None = None
        self._index: dict | None = None
        self._reuse()

    # ------------------------------------------------------------------ writing (the first pass)
    def append(self, batch):
        """Keep ``batch``; returns it as later passes will see it (on the store's device in RAM tiers)."""
        tensors = [getattr(batch, f) for f in self.fields]
        if self.tier is None:
            rows = max(1, int(tensors[0].shape[0]))
            per_row = sum(t.element_size() * t.numel() for t in tensors) / rows
            self.tier = choose_tier(int(per_row * self.expected_rows), self.device, self.cache_gb)
            if self.tier == "disk":
                self._start_disk(tensors)
        if self.tier == "disk":
            self._writer.write(tensors)
            return batch
        batch = batch.to(self.device if self.tier == "device" else torch.device("cpu"))
        self._mem.append(batch)
        return batch

    def _start_disk(self, tensors: Sequence[torch.Tensor]) -> None:
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="mariana-rows-"))
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        self._writer = _ShardWriter(self.folder, self.shard_bytes)
        self._layout = [(str(t.dtype).removeprefix("torch."), list(t.shape[1:])) for t in tensors]

    def finish(self, extra: dict | None = None) -> None:
        """The pass is whole: later reads may start. The disk tier closes its last shard and writes the
        index (with ``extra``, JSON-able, returned as ``self.extra`` when a later run reuses the store)."""
        self.extra = dict(extra or {})
        if self.tier == "disk":
            w = self._writer
            w.close_shard()
            self._index = {
                "format": FORMAT,
                "fingerprint": self.fingerprint,
                "fields": [[n, d, s] for n, (d, s) in zip(self.fields, self._layout)],
                "shards": w.sizes,
                "batches": w.entries,
                "extra": self.extra,
            }
            atomic_write_text(self.folder / "index.json", json.dumps(self._index))
            self._writer = None
        self.complete = True

    def clear(self) -> None:
        """Forget everything (a first pass that starts over); the tier is decided again."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        self._mem, self._index, self.tier, self.complete, self.extra = [], None, None, False, {}
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def close(self) -> None:
        """The run is over: delete the shards (and free the RAM tiers' batches)."""
        self.clear()

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        if self._index is not None:
            return len(self._index["batches"])
        return len(self._writer.entries) if self._writer is not None else len(self._mem)

    def __getitem__(self, k: int):
        """Batch ``k`` (0-based, in append order); on disk: tensors viewing the mapped shard (CPU)."""
        if self._index is None:
            return self._mem[k]
        shard, offset, rows = self._index["batches"][k]
        fields = self._index["fields"]
        sizes = [rows * np.dtype(d).itemsize * int(np.prod(s, dtype=np.int64)) for _, d, s in fields]
        mm = _map(self.folder / f"shard-{shard:05d}.bin", offset, sum(map(_padded, sizes)))
        out, at = [], 0
        for (_, d, s), n in zip(fields, sizes):
            out.append(torch.from_numpy(mm[at : at + n].view(np.dtype(d)).reshape(rows, *s)))
            at += _padded(n)
        return self.make(*out)

    def _reuse(self) -> None:
        """Adopt a whole store of the same fingerprint left in ``folder`` (else delete what is there)."""
        if self.folder is None:
            return
        index_path = self.folder / "index.json"
        try:
            index = json.loads(index_path.read_text())
            shards_ok = all(
                (self.folder / f"shard-{i:05d}.bin").stat().st_size == n
                for i, n in enumerate(index["shards"])
            )
            same = index["format"] == FORMAT and index["fingerprint"] == self.fingerprint
            names_ok = [f[0] for f in index["fields"]] == list(self.fields)
        except (OSError, ValueError, KeyError, TypeError):
            shards_ok = same = names_ok = False
        if shards_ok and same and names_ok:
            self._index, self.tier, self.complete = index, "disk", True
            self.extra = index.get("extra", {})
        else:
            shutil.rmtree(self.folder, ignore_errors=True)
