"""Compile start-up paid once: torch.compile's artifacts (inductor's compiled graphs and kernels, autotuning
results) saved after a run and loaded before the next one with the same model, shapes and software.

The file lives in ``$MARIANA_COMPILE_CACHE`` or ``~/.cache/mariana/compile``, named by a digest of the
torch version, the device and the caller's key (the model's config, the input shapes' description), so a
different model or torch never loads another's artifacts (torch would also reject them by its own keys).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from .atomic import atomic_write_bytes

log = logging.getLogger("mariana")


def cache_path(key: str, device: torch.device) -> Path:
    """The artifacts file for ``key`` (any text naming the model and shapes) compiled for ``device``."""
    root = Path(os.environ.get("MARIANA_COMPILE_CACHE") or Path.home() / ".cache" / "mariana" / "compile")
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    digest = hashlib.sha1(f"{torch.__version__}|{dev}|{key}".encode()).hexdigest()[:16]
    return root / f"{digest}.bin"


def load(path: Path) -> bool:
    """Load saved artifacts into torch's compile caches (before the first compiled call); False if none."""
    if not path.is_file():
        return False
    try:
        torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as e:  # a stale or foreign file: compile from scratch and overwrite it later
        log.warning("compile cache %s not loaded (%s): compiling from scratch", path, e)
        return False
    return True


def save(path: Path) -> bool:
    """Write the artifacts compiled in this process so far (atomically); False when there are none."""
    art = torch.compiler.save_cache_artifacts()
    if art is None:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, art[0])
    return True
