"""Model export: weights as safetensors plus a JSON description, loadable without pickled classes.

``RUN/model.safetensors`` holds the state dict (CPU, contiguous) with the metadata JSON embedded under the
``mariana`` key; ``RUN/model.json`` repeats the metadata for people and tools. Loading never executes code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save_file as st_save_file

from .atomic import atomic_write_path, atomic_write_text
from .errors import MarianaError

WEIGHTS = "model.safetensors"
META = "model.json"


def export_model(run_dir: str | Path, state_dict: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write ``RUN/model.safetensors`` and ``RUN/model.json`` atomically; returns the weights path.

    Tensors are moved to CPU and de-aliased (safetensors refuses shared storage); a tensor that already
    owns its storage is written as is and streamed to the file (a multi-GB embedding table is not copied)."""
    run_dir = Path(run_dir)
    tensors, owned = {}, set()
    for k, v in state_dict.items():
        v = v.detach().to("cpu")
        st = v.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        whole = v.is_contiguous() and v.storage_offset() == 0 and v.nbytes == st.nbytes()
        if key in owned or not whole:
            v = v.clone().contiguous()
        else:
            owned.add(key)
        tensors[k] = v
    meta_text = json.dumps(meta, sort_keys=True, default=str)
    path = atomic_write_path(
        run_dir / WEIGHTS, lambda tmp: st_save_file(tensors, tmp, metadata={"mariana": meta_text})
    )
    atomic_write_text(run_dir / META, json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
    return path


def load_exported(
    run_dir: str | Path, device: str | torch.device = "cpu"
) -> tuple[dict[str, torch.Tensor], dict]:
    """Read an exported model: (state dict on ``device``, metadata dict). ``run_dir`` may also be the
    ``.safetensors`` file itself. ``meta["app"]`` names the app that trained it (taken from ``job`` for
    runs that only have that key), so a wrong ``--model`` can be named in an error message."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / WEIGHTS
    if not path.is_file():
        raise MarianaError(f"no exported model at {path} (train first, or point --model at a run directory)")
    data = path.read_bytes()
    try:
        tensors = st_load(data)
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("mariana", "{}"))
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise MarianaError(f"{path}: not a readable safetensors model file ({e})") from None
    if "app" not in meta and meta.get("job"):  # runs that name their app "job" (mlp, asr)
        meta["app"] = meta["job"]
    return {k: v.to(device) for k, v in tensors.items()}, meta
