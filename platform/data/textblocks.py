"""Line-oriented text files (``.gz``/``.bz2`` decompressed as they are read) read in blocks of whole lines, for parsers that work on many lines at once.

A line ends at ``\\n`` (a ``\\r`` before it belongs to the line and parsers strip it); line ``i`` is
0-based, counted the way `count_lines` counts. `read_blocks` yields ``(first_line, bytes)`` blocks of
whole lines between two line numbers; `lines_array` views a block as an Arrow string array without
copying; `ordered_map` runs a block parser on a thread pool and yields results in file order (Arrow and
numpy release the GIL, so two cores parse two blocks at once).

Files are read as bytes, decompressed on the fly by suffix (`open_data`, `pieces`): ``.gz`` and ``.bz2`` (how
click logs are distributed) stream through `gzip`/`bz2`, read once from the start (line-range readers count
lines up to their start, never seek to a byte offset); ``.zst`` is refused by name (no zstandard).
"""

from __future__ import annotations

import bz2
import gzip
import itertools
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np

from ..core.errors import DataError

OPENERS = {".gz": gzip.open, ".bz2": bz2.open}


def open_data(path: str | Path) -> BinaryIO:
    """``path`` open for reading its (decompressed) bytes; DataError for a ``.zst`` file."""
    p = Path(path)
    if p.suffix.lower() in (".zst", ".zstd"):
        raise DataError(f"{p}: zstd-compressed files are not read; decompress it (zstd -d) or gzip it")
    return OPENERS.get(p.suffix.lower(), open)(p, "rb")


def pieces(path: str | Path, size: int = 1 << 20, text: Iterable | None = None) -> Iterator:
    """``path``'s (decompressed) bytes in pieces of ``size`` (or the items of ``text``, a text view of
    `open_data`); a corrupt or truncated stream (OSError, EOFError while reading) is one DataError."""
    f = open_data(path) if text is None else None  # a missing file: FileNotFoundError, as open's
    try:
        if f is None:
            yield from text
            return
        with f:
            while data := f.read(size):
                yield data
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot be read ({e or type(e).__name__}); is the file complete?") from None


T = TypeVar("T")
R = TypeVar("R")

NL = 10  # b"\n"


def _newlines(buf: bytes | memoryview) -> np.ndarray:
    """Positions of ``\\n`` in ``buf`` (int64 [k])."""
    return np.flatnonzero(np.frombuffer(buf, dtype=np.uint8) == NL)


def read_blocks(
    path: str | Path,
    start: int = 0,
    stop: int | None = None,
    max_lines: int = 65536,
    block_bytes: int = 2 << 20,
) -> Iterator[tuple[int, bytes]]:
    """Yield ``(first_line, block)``: whole lines ``[start, stop)`` of ``path`` (0-based line numbers),
    each block at most ``max_lines`` lines and about ``block_bytes`` bytes (longer if one line is)."""
    if max_lines < 1:
        raise ValueError(f"max_lines must be >= 1, got {max_lines}")
    line = 0  # number of the next line to emit
    pending = b""
    for data in itertools.chain(pieces(path, block_bytes), [b""]):  # b"": the end
        eof = not data
        buf = pending + data
        if not buf:
            return
        if eof:
            cut = len(buf)
        else:
            nl = _newlines(buf)
            if len(nl) == 0:
                pending = buf
                continue
            cut = int(nl[-1]) + 1
        whole, pending = buf[:cut], buf[cut:]
        pos = np.concatenate([[0], _newlines(whole) + 1])  # start of each line (+ the end)
        if pos[-1] != len(whole):
            pos = np.append(pos, len(whole))
        count = len(pos) - 1
        a = max(start - line, 0)  # lines of this piece to emit: [a, b)
        b = count if stop is None else min(count, stop - line)
        while a < b:
            e = min(b, a + max_lines)
            yield line + a, whole[pos[a] : pos[e]]
            a = e
        line += count
        if (stop is not None and line >= stop) or eof:
            return


def lines_array(block: bytes):
    """``block`` (ASCII, whole lines) as a pyarrow ``StringArray`` of its lines, each with its line end,
    sharing the block's memory."""
    import pyarrow as pa

    pos = np.concatenate([[0], _newlines(block) + 1]).astype(np.int32)
    if pos[-1] != len(block):
        pos = np.append(pos, np.int32(len(block)))
    return pa.StringArray.from_buffers(len(pos) - 1, pa.py_buffer(pos), pa.py_buffer(block))


def ordered_map(fn: Callable[[T], R], items: Iterable[T], threads: int = 0, ahead: int = 2) -> Iterator[R]:
    """``map(fn, items)`` on ``threads`` threads (0: one per core), results in input order, at most
    ``threads * ahead`` items in flight (memory stays bounded on a file of any size)."""
    threads = threads or os.cpu_count() or 1
    if threads == 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="parse") as pool:
        futures: deque = deque()
        try:
            for item in items:
                futures.append(pool.submit(fn, item))
                if len(futures) >= threads * ahead:
                    yield futures.popleft().result()
            while futures:
                yield futures.popleft().result()
        finally:
            for fut in futures:
                fut.cancel()
