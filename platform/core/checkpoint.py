"""Atomic, resumable checkpoints.

``RUN/checkpoints/step_XXXXXXXX/state.pt`` (rank 0: model, optimizer, scheduler, step, data position, extra)
and ``rng-rank-R.pt`` (every rank's RNG states). Each file is written atomically; after a barrier rank 0
points ``RUN/checkpoints/latest`` at the new folder (atomically too), so ``latest`` only ever names a
complete checkpoint. Older checkpoints beyond ``keep`` are removed after that. Everything saved is tensors,
containers and numbers: `load_checkpoint` uses ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
import shutil
from typing import Any

import numpy as np
import torch

from .atomic import atomic_torch_save, atomic_write_text
from .errors import MarianaError
from .rundir import RunDir


def rng_state() -> dict[str, Any]:
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run: RunDir, step: int, state: dict[str, Any] | None, rank: int, barrier, keep: int = 2
) -> None:
    """Write this rank's part of the checkpoint for ``step``; ``state`` is rank 0's (None elsewhere).
    ``barrier()`` synchronises the ranks (a no-op in one process)."""
    name = f"step_{step:08d}"
    folder = run.ckpt_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(rng_state(), folder / f"rng-rank-{rank}.pt")
    if state is not None:
        atomic_torch_save(state, folder / "state.pt")
    barrier()
    if rank == 0:
        atomic_write_text(run.ckpt_dir / "latest", name + "\n")
        old = sorted(p for p in run.ckpt_dir.glob("step_*") if p.is_dir() and p.name != name)
        for p in old[: max(0, len(old) - (keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(run: RunDir, rank: int = 0) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(rank-0 state, this rank's RNG state or None) of the checkpoint named by ``latest``."""
    latest = run.ckpt_dir / "latest"
    if not latest.is_file():
        raise MarianaError(f"--resume: no checkpoint in {run.ckpt_dir}")
    folder = run.ckpt_dir / latest.read_text().strip()
    try:
        state = torch.load(folder / "state.pt", map_location="cpu", weights_only=True)
        rng_path = folder / f"rng-rank-{rank}.pt"
        rng = torch.load(rng_path, map_location="cpu", weights_only=True) if rng_path.is_file() else None
    except (OSError, RuntimeError) as e:
        raise MarianaError(f"checkpoint {folder} cannot be read: {e}") from None
    return state, rng
