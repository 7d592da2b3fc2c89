"""The served models: loading through each app's serving loader (`AppSpec.loader`), versions, atomic hot
reload, file watching.

A `ModelSlot` holds one app's current `Loaded` model. A reload builds the new model completely on a worker
thread, then swaps the reference in one assignment: requests holding the old one finish on it, and a
model that fails to load is refused while the old one keeps serving. Model files are read through
safetensors / JSON (no pickle); a model's version is its weights' digest (``obj.version``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mariana.platform.core.errors import MarianaError
from mariana.platform.core.registry import AppSpec, find_app, resolve, serving_apps

log = logging.getLogger("mariana.serving")

# The files whose change means "a new model version was exported" (written atomically by export_model).
MODEL_FILES = ("model.safetensors", "model.json")


def files_signature(run_dir: str | Path) -> tuple:
    """(name, mtime_ns, size) of the run's model files: changes whenever a new model is exported."""
    p = Path(run_dir)
    out = []
    for name in MODEL_FILES:
        f = p / name if p.is_dir() else p
        try:
            st = f.stat()
            out.append((name, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((name, None, None))
    return tuple(out)


@dataclass(frozen=True)
class Loaded:
    """One loaded model version: the app's inference object plus where and when it came from."""

    app: str
    obj: Any
    version: str
    run_dir: str
    signature: tuple
    loaded_at: float = field(default_factory=time.time)

    def describe(self) -> dict:
        return {"version": self.version, "run_dir": self.run_dir, "loaded_at": round(self.loaded_at, 3)}


def serving_spec(app: str) -> AppSpec:
    """The registered app ``app`` if it can be served, else MarianaError naming the apps that can."""
    spec = find_app(app)
    if spec is None or not spec.servable:
        names = ", ".join(s.name for s in serving_apps())
        what = "is not a known app" if spec is None else "models cannot be served"
        raise MarianaError(f"{app!r} {what} (expected one of {names})")
    return spec


def load_model(app: str, run_dir: str | Path, runtime: str = "torch") -> Loaded:
    """Load ``app``'s model from ``run_dir`` with the app's serving loader (``runtime`` "onnxruntime": scoring
    through its ONNX export, `mariana.serving.onnx_runtime`); raises MarianaError (naming the run dir) when
    it cannot."""
    spec = serving_spec(app)
    run_dir = str(run_dir)
    if not Path(run_dir).exists():
        raise MarianaError(f"--{app} {run_dir}: no such run directory")
    sig = files_signature(run_dir)  # before loading: a change during the load triggers another reload
    try:
        obj = (
            resolve("mariana.serving.onnx_runtime:load")(spec, run_dir)
            if runtime != "torch"
            else spec.load(run_dir)
        )
    except MarianaError as e:
        raise MarianaError(f"--{app} {run_dir}: {e}") from None
    except ModuleNotFoundError as e:
        raise MarianaError(f"--{app}: this build has no {app} inference module ({e.name})") from None
    except Exception as e:  # noqa: BLE001  -- any loader failure means "refuse this model"
        raise MarianaError(f"--{app} {run_dir}: model failed to load: {type(e).__name__}: {e}") from None
    missing = [m for m in spec.requires if not callable(getattr(obj, m, None))]
    if missing:
        raise MarianaError(f"--{app} {run_dir}: loaded object lacks {', '.join(missing)}()")
    version = getattr(obj, "version", None)
    if not isinstance(version, str) or not version:
        version = "unknown"
    return Loaded(app, obj, version, run_dir, sig)


class ModelSlot:
    """The current model of one app, swapped atomically by `reload`; ``on_change(loaded)`` updates metrics."""

    def __init__(
        self,
        app: str,
        run_dir: str,
        on_change: Callable[[Loaded], None] | None = None,
        on_reload: Callable[[str], None] | None = None,
        runtime: str = "torch",
    ):
        self.app, self.on_change, self.on_reload, self.runtime = app, on_change, on_reload, runtime
        self._reload_lock = threading.Lock()  # one reload at a time; serving never takes it
        self.current: Loaded = self._load(run_dir)
        self._last_failed_sig: tuple | None = None
        if on_change:
            on_change(self.current)

    def _load(self, run_dir: str) -> Loaded:
        return load_model(self.app, run_dir, self.runtime)

    def reload_sync(self, run_dir: str | None = None) -> tuple[Loaded, Loaded]:
        """Load ``run_dir`` (default: the current run dir) and swap it in; returns (old, new).
        Raises MarianaError and keeps the old model when the new one fails to load."""
        with self._reload_lock:
            old = self.current
            target = str(run_dir or old.run_dir)
            try:
                new = self._load(target)
            except MarianaError:
                self._last_failed_sig = files_signature(target)
                if self.on_reload:
                    self.on_reload("failed")
                raise
            self.current = new  # the atomic switch: one reference assignment
            self._last_failed_sig = None
            if self.on_reload:
                self.on_reload("ok")
            if self.on_change:
                self.on_change(new)
            log.warning(
                "%s: now serving version %s from %s (was %s)", self.app, new.version, target, old.version
            )
            return old, new

    async def reload(self, run_dir: str | None = None) -> tuple[Loaded, Loaded]:
        return await asyncio.to_thread(self.reload_sync, run_dir)

    def changed_on_disk(self) -> bool:
        """True when the run dir's model files differ from the loaded (and the last refused) version."""
        sig = files_signature(self.current.run_dir)
        return sig != self.current.signature and sig != self._last_failed_sig


async def watch(slots: dict[str, ModelSlot], interval_s: float) -> None:
    """Poll the model files of every slot; reload when they change (the ``--watch`` flag)."""
    while True:
        await asyncio.sleep(interval_s)
        for slot in slots.values():
            try:
                if slot.changed_on_disk():
                    await slot.reload()
            except MarianaError as e:
                log.error("%s: new model refused, still serving %s: %s", slot.app, slot.current.version, e)
            except Exception:  # noqa: BLE001  -- the watcher must survive anything
                log.exception("%s: watch failed", slot.app)
