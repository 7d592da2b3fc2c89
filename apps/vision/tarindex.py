"""Fast member index of an uncompressed tar: ``(name, data offset, size)`` of each regular file.

``tarfile`` builds a Python ``TarInfo`` per member, slower than decoding 50,000 small images (timings:
apps/vision/README.md), so plain ustar/GNU headers are walked here from a memory map; any other header
(PAX or GNU long names, links, sparse files, a bad checksum) returns None: the caller uses ``tarfile``.
"""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import numpy as np

BLOCK = 512
_REGULAR = (b"0", b"\0")  # tarfile's REGTYPE, AREGTYPE
_DIR = b"5"


def scan_tar(path: str | Path) -> list[tuple[str, int, int]] | None:
    """Regular-file members of ``path`` as ``(name, offset of the data, size in bytes)`` in file order,
    names as ``tarfile`` spells them (ustar prefix joined, filesystem encoding); None when the file holds
    anything this walk does not handle (then use ``tarfile``)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < BLOCK:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _walk(mm)


def _walk(mm: mmap.mmap) -> list[tuple[str, int, int]] | None:
    out, heads, off, end = [], [], 0, len(mm)
    enc = sys.getfilesystemencoding()  # tarfile's default encoding
    while off + BLOCK <= end:
        if mm[off] == 0 and mm[off : off + BLOCK].count(0) == BLOCK:  # end-of-archive marker
            if off == 0:
                return None  # tarfile calls a file that starts with one "empty"
            break
        if mm[off + 257 : off + 262] != b"ustar":
            return None
        kind, size = mm[off + 156 : off + 157], _octal(mm[off + 124 : off + 136])
        if size is None or (kind not in _REGULAR and (kind != _DIR or size)):
            return None
        name = mm[off : off + 100].split(b"\0", 1)[0]
        prefix = mm[off + 345 : off + 500].split(b"\0", 1)[0]  # joined whatever the magic, as tarfile does
        if prefix:
            name = prefix + b"/" + name
        heads.append(off)
        if kind in _REGULAR:
            out.append((name.decode(enc, "surrogateescape"), off + BLOCK, size))
        off += BLOCK + -(-size // BLOCK) * BLOCK
    if off < end < off + BLOCK:  # a truncated header: let tarfile judge
        return None
    return out if _checksums_ok(mm, heads) else None


def _octal(field: bytes) -> int | None:
    """The ustar size field (octal digits, NUL/space padded); None for base-256 or garbage."""
    digits = field.split(b"\0", 1)[0].strip(b" ")
    if not digits:
        return 0
    try:
        return int(digits, 8)
    except ValueError:
        return None


def _checksums_ok(mm: mmap.mmap, heads: list[int]) -> bool:
    """Every header's checksum, in one vectorised pass: the unsigned byte sum with the checksum field
    read as spaces (tarfile also accepts the historic signed sum, which only differs for non-ASCII bytes:
    then the caller falls back to tarfile)."""
    if not heads:
        return True
    buf = np.frombuffer(mm, dtype=np.uint8)
    hdr = buf[np.asarray(heads)[:, None] + np.arange(BLOCK)]
    field = hdr[:, 148:156]
    calc = hdr.sum(axis=1, dtype=np.int64) - field.sum(axis=1, dtype=np.int64) + 8 * 32
    # the usual spelling "DDDDDD\0 " (tarfile, GNU tar) parsed vectorised; any other one by `_octal`
    usual = ((field[:, :6] >= 48) & (field[:, :6] <= 55)).all(axis=1) & np.isin(field[:, 6], (0, 32))
    want = (field[:, :6].astype(np.int64) - 48) @ (8 ** np.arange(5, -1, -1, dtype=np.int64))
    if not (want[usual] == calc[usual]).all():
        return False
    odd = np.flatnonzero(~usual).tolist()
    return all(_octal(bytes(field[i])) == calc[i] for i in odd)
