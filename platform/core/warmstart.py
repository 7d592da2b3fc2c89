"""Warm start (``--init-from``): a new run whose first weights come from an earlier run or export.

Unlike ``--resume`` (the same run continued exactly: optimizer, schedule, data position, RNG), a warm
start only copies weights; the optimizer and the schedule start fresh. The source is a run directory or
its ``model.safetensors`` (loaded with safetensors: no code is executed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .errors import MarianaError
from .export import load_exported


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
