"""Data files read as bytes, decompressed on the fly by suffix (standard library only): ``.gz`` and ``.bz2``
(how click logs are distributed) stream through `gzip`/`bz2`, read once from the start (line-range readers
count lines up to their start, never seek to a byte offset); ``.zst`` is refused by name (no zstandard)."""

from __future__ import annotations

import bz2
import gzip
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

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
