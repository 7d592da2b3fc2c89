"""Atomic file writes: write a temporary file in the same folder, fsync, then rename over the target.

A reader (or a restarted job) therefore sees either the old file or the complete new one, never a torn
write, even if the process is killed mid-write.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO


@contextlib.contextmanager
def _temp_beside(path: Path) -> Iterator[str]:
    """Yield a temporary file name next to ``path``; when the block ends, fsync it and rename it over
    ``path`` (on an exception: delete it, leaving ``path`` as it was)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_with(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(f)`` on a temporary file next to ``path``, fsync, rename over ``path``."""
    path = Path(path)
    with _temp_beside(path) as tmp, open(tmp, "wb") as f:
        write(f)
    return path


def atomic_write_path(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Call ``write(tmp_path)`` for a library that writes by file name, fsync, rename over ``path``."""
    path = Path(path)
    with _temp_beside(path) as tmp:
        write(tmp)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    return atomic_write_with(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` to ``path`` atomically. Save tensors/containers/numbers only, so that
    ``torch.load(path, weights_only=True)`` can read it back without executing code."""
    import torch

    # Straight into the temporary file: no in-memory copy (checkpoints of embedding shards are GBs).
    return atomic_write_with(path, lambda f: torch.save(obj, f))
