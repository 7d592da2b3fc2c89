"""Model export, one format for every app: ``RUN/model.safetensors`` + ``RUN/model.json``.

The weights file holds the state dict (CPU, contiguous) with the metadata JSON embedded under the
``mariana`` key; ``model.json`` repeats it for people and tools. Loading never executes code. The
metadata: ``app``, ``arch``, ``config`` (the resolved training config), ``metrics`` (final scalars, may be
empty), ``created`` (ISO-8601 UTC), ``version`` (`weights_digest`: the same weights always have the same
version, whatever run produced them), plus the app's own keys (vocabulary, classes, schema, ...).

Warm start (``--init-from``, `warm_start`): a new run whose first weights come from an earlier run or export.
Unlike ``--resume`` (the same run continued exactly: optimizer, schedule, data position, RNG), a warm start
only copies weights; the optimizer and the schedule start fresh. The source is a run directory or its
``model.safetensors`` (loaded with safetensors: no code is executed).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file as st_save_file

from . import jsonfile
from .atomic import atomic_write_path, atomic_write_text
from .errors import MarianaError

WEIGHTS = "model.safetensors"
META = "model.json"
REQUIRED_KEYS = ("app", "arch", "config", "created", "metrics", "version")
_HASH_CHUNK = 64 << 20  # bytes hashed per update: a multi-GB table is never copied


def weights_digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """First 16 hex digits of the SHA-256 over every tensor's name, dtype, shape and bytes (in name
    order), computed tensor by tensor straight from the tensors' memory (nothing concatenated)."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        head = f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0{t.nbytes}\0".encode()
        h.update(len(head).to_bytes(8, "little") + head)
        if t.numel():
            mem = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            for i in range(0, len(mem), _HASH_CHUNK):
                h.update(mem[i : i + _HASH_CHUNK])
    return h.hexdigest()[:16]


def _plain_config(config: Any) -> dict:
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return dict(config)


def _scalar_metrics(metrics: Mapping[str, Any] | None) -> dict:
    """The scalar entries (numbers, strings, booleans) of a final-metrics dict."""
    return {k: v for k, v in (metrics or {}).items() if isinstance(v, int | float | str | bool)}


def export_model(
    run_dir: str | Path,
    state_dict: Mapping[str, torch.Tensor],
    *,
    app: str,
    arch: str,
    config: Any,
    metrics: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``RUN/model.safetensors`` and ``RUN/model.json`` atomically; returns the weights path.

    ``config`` is the resolved config (dataclass or dict); ``metrics`` keeps its scalar entries; ``extra``
    (the app's own keys) is merged at the top level, where the keys above (``app``, ``version``, ...) win.
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
    meta = {
        **(extra or {}),
        "app": app,
        "arch": arch,
        "config": _plain_config(config),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "metrics": _scalar_metrics(metrics),
        "version": weights_digest(tensors),
    }
    meta_text = jsonfile.dumps(meta, sort_keys=True, default=str)
    path = atomic_write_path(
        run_dir / WEIGHTS, lambda tmp: st_save_file(tensors, tmp, metadata={"mariana": meta_text})
    )
    atomic_write_text(run_dir / META, jsonfile.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
    return path


def load_exported(
    run_dir: str | Path, device: str | torch.device = "cpu", app: str = ""
) -> tuple[dict[str, torch.Tensor], dict]:
    """Read an exported model: (state dict on ``device``, metadata dict). ``run_dir`` may also be the
    ``.safetensors`` file itself; ``app``: refuse a model another app trained (one line naming both).

    The file is memory-mapped (safetensors ``safe_open``), never read whole into one buffer, and each tensor
    is copied out of the mapping into memory the process owns, one at a time: peak memory is the model
    once (plus page cache), and a file overwritten in place later (``cp`` onto a served model) cannot
    fault the process (SIGBUS) through a stale mapping. ``meta["app"]`` names the app that trained it
    (taken from ``job`` for old runs that only have that key), so a wrong ``--model`` can be named in an
    error message; ``meta["version"]`` is the weights' digest (computed here for exports older than it)."""
    from safetensors import safe_open

    path = Path(run_dir)
    if path.is_dir():
        path = path / WEIGHTS
    if not path.is_file():
        raise MarianaError(f"no exported model at {path} (train first, or give the run directory)")
    on_cpu = torch.device(device).type == "cpu"
    tensors = {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = json.loads((f.metadata() or {}).get("mariana", "{}"))
            for k in f.keys():  # noqa: SIM118  -- safe_open is not iterable
                t = f.get_tensor(k)  # a view of the mapped file
                tensors[k] = t.clone() if on_cpu else t.to(device)
                del t
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise MarianaError(f"{path}: not a readable safetensors model file ({e})") from None
    if not isinstance(meta, dict):
        raise MarianaError(f"{path}: not a readable safetensors model file (metadata is not an object)")
    if "app" not in meta and meta.get("job"):  # old runs that name their app "job" (mlp, asr)
        meta["app"] = meta["job"]
    if app and meta.get("app") != app:
        made_by = f"`mariana {meta['app']} train`" if meta.get("app") else "no known app"
        raise MarianaError(
            f"{path}: not a model of `mariana {app} train` (it was exported by {made_by}; expected a {app} run)"
        )
    if not meta.get("version"):
        meta["version"] = weights_digest(tensors)
    return tensors, meta


def load_init(path: str | Path, app: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, metadata) of the model at ``path``; MarianaError if another app trained it."""
    state, meta = load_exported(path)
    if meta.get("app") not in (None, app):
        raise MarianaError(f"--init-from {path}: a {meta.get('app')} model, expected a {app} model")
    return state, meta


def warm_start(module: torch.nn.Module, path: str | Path, app: str) -> dict[str, Any]:
    """Copy the weights at ``path`` into ``module`` (same names and shapes required); returns the
    source's metadata. MarianaError naming the first differing tensor otherwise."""
    state, meta = load_init(path, app)
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    extra = [k for k in state if k not in own]
    if missing or extra:
        raise MarianaError(
            f"--init-from {path}: the saved model does not match this configuration "
            f"(missing {missing[:3]}, unexpected {extra[:3]}); use the same model settings"
        )
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise MarianaError(
                f"--init-from {path}: tensor {k!r} has shape {tuple(v.shape)}, this model's is "
                f"{tuple(own[k].shape)}; use the same model settings"
            )
    module.load_state_dict(state)
    return meta


def warm_start_note(cfg: Any, final: dict, hint: str = "") -> str:
    """The words a headline adds when a warm start exported its source model unchanged: with
    ``--init-from`` the first evaluation (step 0) scores the source, and when no later step beats it the
    best model, the one exported, is the source. '' otherwise. ``hint``: the app's way to learn anyway."""
    if not getattr(cfg, "init_from", "") or final.get("exported_step") != 0:
        return ""
    note = (
        f"; no step beat the --init-from model on the validation rows, so the exported model is "
        f"{cfg.init_from} unchanged"
    )
    return note + (f" ({hint})" if hint else "")
