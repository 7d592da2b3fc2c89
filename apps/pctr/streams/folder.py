"""The folder a `pctr stream` follows: its complete units (files and finished partitions) in arrival
order (`scan`); the rules: apps/pctr/README.md, "Streaming"."""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path

from mariana.platform.core.errors import MarianaError

from ..configs import DATA_FILES
from ..data.encoding import Batch, Encoder, ReadStats, load_split
from ..data.sources import ignored


@dataclass
class LogFile:
    """One complete unit of the stream. ``name``: path relative to the folder (a partition ends in ``/``);
    ``paths``: its data files in reading order; ``size``: bytes; ``mtime_ns``: the order key (the file's, or
    the partition's ``_SUCCESS``'s); ``landed``: seconds since the epoch it became complete."""

    name: str
    paths: list[Path]
    size: int
    mtime_ns: int
    landed: float


def scan(folder: Path, files: str = DATA_FILES) -> list[LogFile]:
    """The complete units in ``folder`` in arrival order (modification time, then name): its files whose
    names match a pattern of ``files`` (``--files``, comma-separated) and its finished partitions."""
    out, patterns = [], [g.strip() for g in files.split(",") if g.strip()]
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        raise MarianaError(f"--data {folder}: the folder disappeared") from None
    for e in entries:
        if ignored(e.name):
            continue
        try:
            if e.is_file():
                if not any(fnmatch.fnmatchcase(e.name, g) for g in patterns):
                    continue  # not a data file by its name (a user's README.txt): left alone
                s = e.stat()
                out.append(
                    LogFile(e.name, [Path(e.path)], s.st_size, s.st_mtime_ns, max(s.st_mtime, s.st_ctime))
                )
            elif e.is_dir():
                marker = Path(e.path) / "_SUCCESS"
                if not marker.is_file():
                    continue  # partition still being written
                m = marker.stat()
                parts = sorted(
                    (p for p in Path(e.path).iterdir() if p.is_file() and not ignored(p.name)),
                    key=lambda p: p.name,
                )
                size = sum(p.stat().st_size for p in parts)
                out.append(LogFile(e.name + "/", parts, size, m.st_mtime_ns, max(m.st_mtime, m.st_ctime)))
        except FileNotFoundError:
            continue  # renamed or removed while scanning: seen on the next scan, or never
    out.sort(key=lambda f: (f.mtime_ns, f.name))
    return out


def read_unit(f: LogFile, encoder: Encoder, folder: Path) -> tuple[Batch | None, int, str]:
    """The unit's valid rows as one `Batch` (None if it disappeared), its skipped lines, and the first
    skipped line as ``"[part: ]line N: error"`` ('' when none). MarianaError if it cannot be read."""
    parts, skipped, first = [], 0, ""
    try:
        for p in f.paths:
            stats = ReadStats()
            parts.append(load_split(p, encoder, 0, None, stats=stats))
            skipped += stats.skipped
            if stats.errors and not first:
                n = min(stats.errors)
                where = f"{p.name}: " if len(f.paths) > 1 else ""
                first = f"{where}line {n}: {stats.errors[n]}"
    except FileNotFoundError:
        return None, 0, ""
    except OSError as e:
        raise MarianaError(f"{folder / f.name}: cannot be read ({e.strerror or e})") from None
    return Batch.cat(parts), skipped, first
