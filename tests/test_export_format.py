"""The one export format (`mariana.platform.core.export`): required metadata, the weights' content digest
as the version, and loading through a memory map (never the whole file read into memory first)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.export import REQUIRED_KEYS, export_model, load_exported, weights_digest


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "w": torch.randn(4, 3),
        "b": torch.zeros(3, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.0),
        "empty": torch.zeros(0, 5),
        "flags": torch.tensor([1, 0, 1], dtype=torch.uint8),
    }


def test_metadata_and_version_digest(tmp_path):
    sd = _state()
    extra = {"vocab": ["a", "b"], "version": "old-scheme", "app": "ignored"}
    export_model(
        tmp_path, sd, app="t", arch="tiny", config={"x": 1}, metrics={"auc": 0.5, "h": [1]}, extra=extra
    )
    meta = json.loads((tmp_path / "model.json").read_text())
    assert set(REQUIRED_KEYS) <= set(meta)
    assert (meta["app"], meta["arch"], meta["config"], meta["vocab"]) == ("t", "tiny", {"x": 1}, ["a", "b"])
    assert meta["metrics"] == {"auc": 0.5}  # scalar metrics only
    assert meta["created"].endswith("Z") and "job" not in meta
    assert meta["version"] == weights_digest(sd) != "old-scheme"  # the digest overrides any other scheme
    state, embedded = load_exported(tmp_path)
    assert embedded == meta and weights_digest(state) == meta["version"]
    for k, v in sd.items():
        assert torch.equal(state[k], v) and state[k].dtype == v.dtype, k


def test_digest_changes_with_any_weight_and_not_with_time_or_order():
    sd = _state()
    d = weights_digest(sd)
    assert d == weights_digest(dict(reversed(list(sd.items()))))  # name order, not insertion order
    changed = {k: v.clone() for k, v in sd.items()}
    changed["w"][2, 1] += 1e-3
    assert weights_digest(changed) != d
    assert weights_digest({**sd, "w": sd["w"].reshape(3, 4)}) != d  # same bytes, other shape
    assert weights_digest({**sd, "flags": sd["flags"].to(torch.int8)}) != d  # same bytes, other dtype
    assert weights_digest({"W": sd["w"], **{k: v for k, v in sd.items() if k != "w"}}) != d  # other name
    assert weights_digest({**sd, "w": sd["w"].t().contiguous().t()}) == d  # layout does not matter


def test_load_is_memory_mapped_never_read_bytes(tmp_path, monkeypatch):
    sd = _state()
    export_model(tmp_path, sd, app="t", arch="tiny", config={})

    def refuse(self):
        raise AssertionError(f"read_bytes({self}) called: the model must be memory-mapped")

    monkeypatch.setattr(Path, "read_bytes", refuse)
    state, meta = load_exported(tmp_path)
    assert meta["version"] == weights_digest(sd)
    # The loaded tensors own their memory: a model file overwritten in place afterwards (`cp` onto a served
    # model) must not take the process down with SIGBUS through a stale mapping.
    monkeypatch.undo()
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    assert torch.equal(state["w"], sd["w"])
    with pytest.raises(MarianaError, match="not a readable safetensors model file"):
        load_exported(tmp_path)
    with pytest.raises(MarianaError, match="no exported model at"):
        load_exported(tmp_path / "nowhere")
