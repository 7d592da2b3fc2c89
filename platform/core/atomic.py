"""Atomic file writes: write a temporary file in the same folder, fsync, then rename over the target.

A reader (or a restarted job) therefore sees either the old file or the complete new one, never a torn
write, even if the process is killed mid-write.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def atomic_write_with(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(f)`` on a temporary file next to ``path``, fsync, rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_path(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Call ``write(tmp_path)`` for a library that writes by file name, fsync, rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
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
