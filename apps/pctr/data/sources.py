"""``--data`` as one sequence of lines: a file, a comma-separated list of files, or a folder of partitions.

A **list** ``a.tsv,b.tsv`` (when the whole text is not an existing path) is read in the order given; a
**folder** is its regular files in name order, leaving out names starting with ``.`` or ``_`` (markers,
files still being written) and ending in ``.tmp`` or ``.part``. Line numbers, ``--split`` fractions and
workers' line ranges refer to the concatenation (a file without a final newline still ends its last
line); malformed lines are reported with their file and line (`DataSources.where`). Standard library
only: the CLI checks ``--data`` before torch loads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from mariana.platform.core.errors import DataError
from mariana.platform.data.textblocks import pieces

SKIP_SUFFIXES = (".tmp", ".part")


def ignored(name: str) -> bool:
    """Names that are never data: markers (``_SUCCESS``), hidden files and files still being written."""
    return name.startswith((".", "_")) or name.endswith(SKIP_SUFFIXES)


def partition_files(folder: str | Path) -> list[Path]:
    """The data files of a folder of partitions, in name order (see the module docstring)."""
    folder = Path(folder)
    return sorted((p for p in folder.iterdir() if p.is_file() and not ignored(p.name)), key=lambda p: p.name)


def count_file_lines(path: Path) -> int:
    """Number of lines of one file (streaming, 1 MiB blocks; a last line without a newline counts)."""
    n, last = 0, b"\n"
    for block in pieces(path):
        n += block.count(b"\n")
        last = block[-1:]
    return n + (0 if last == b"\n" else 1)


class DataSources:
    """The files behind one ``--data`` value, read as one sequence of lines.

    ``paths``: the files in order. ``counts()``: lines per file (counted once, then kept); ``offsets()``:
    the global line number (0-based) of each file's first line; ``lines()``: the total."""

    def __init__(self, paths: Sequence[Path], spec: str = ""):
        self.paths = [Path(p) for p in paths]
        self.spec = spec or ",".join(map(str, self.paths))
        self._counts: list[int] | None = None

    def __str__(self) -> str:
        return self.spec

    @property
    def single(self) -> bool:
        return len(self.paths) == 1

    def counts(self) -> list[int]:
        if self._counts is None:
            self._counts = [count_file_lines(p) for p in self.paths]
        return self._counts

    def offsets(self) -> list[int]:
        out, acc = [], 0
        for n in self.counts():
            out.append(acc)
            acc += n
        return out

    def lines(self) -> int:
        return sum(self.counts())

    def check_not_empty(self, what: str = "--data") -> None:
        """DataError naming the source when none of its files holds a byte (say so, not "too few rows")."""
        if all(p.stat().st_size == 0 for p in self.paths):
            raise DataError(f"{what} {self.spec}: {'empty file' if self.single else 'every file is empty'}")

    def ranges(self, start: int, stop: int | None) -> list[tuple[int, Path, int, int]]:
        """Global lines ``[start, stop)`` as per-file pieces ``(file's global offset, path, local start,
        local stop)`` in order (files outside the range left out; ``stop`` None: to the end)."""
        out = []
        for off, p, n in zip(self.offsets(), self.paths, self.counts()):
            lo = max(start - off, 0)
            hi = n if stop is None else min(stop - off, n)
            if lo < hi:
                out.append((off, p, lo, hi))
        return out

    def where(self, lineno: int) -> str:
        """``FILE line L`` of a global 1-based line number."""
        for off, p, n in zip(self.offsets(), self.paths, self.counts()):
            if lineno <= off + n:
                return f"{p} line {lineno - off}"
        return f"{self.spec} line {lineno}"


def absolute_list(data: str) -> str:
    """A comma-separated ``--data`` list with each file made absolute (the config layer makes the whole
    text absolute as one path, which leaves the second and later files relative); other values as given."""
    if "," not in data or Path(data).exists():
        return data
    return ",".join(os.path.abspath(os.path.expanduser(s.strip())) for s in data.split(",") if s.strip())


def result_name(data: str) -> str:
    """A name for results about ``data`` (`eval_result_path` uses a path's last component): a comma
    list ``a.tsv,...,z.tsv`` -> ``a_to_z``; a file or folder as given."""
    if "," not in data or Path(data).exists():
        return data
    parts = [Path(x.strip()).stem for x in data.split(",") if x.strip()]
    return parts[0] if len(parts) == 1 else f"{parts[0]}_to_{parts[-1]}"


def resolve_sources(
    data: str | Path | Sequence[str | Path] | DataSources, what: str = "--data"
) -> DataSources:
    """``--data`` -> `DataSources`; DataError naming the missing file, or the folder without data files."""
    if isinstance(data, DataSources):
        return data
    if isinstance(data, (list, tuple)):
        items, spec = [Path(p) for p in data], ",".join(map(str, data))
    else:
        spec = str(data)
        if not spec:
            raise DataError(f"{what} is required")
        p = Path(spec)
        if p.is_dir():
            files = partition_files(p)
            if not files:
                raise DataError(
                    f"{what} {spec}: the folder has no data files (names starting with '.' or '_' and "
                    f"ending in {' or '.join(SKIP_SUFFIXES)} are not data)"
                )
            return DataSources(files, spec)
        items = (
            [p] if p.exists() or "," not in spec else [Path(s.strip()) for s in spec.split(",") if s.strip()]
        )
    if not items:
        raise DataError(f"{what} {spec!r}: no file named")
    for p in items:
        if p.is_dir() and len(items) > 1:
            raise DataError(f"{what}: {p} is a folder; a comma-separated list names files")
        if not p.is_file():
            raise DataError(f"{what} {p}: no such data file")
    return DataSources(items, spec)
