"""The served models: loading through each app's inference API, versions, atomic hot reload, file watching.

A `ModelSlot` holds one app's current `Loaded` model. Reloading builds the new model completely (on a
worker thread, so serving continues), and only then replaces the slot's reference in one assignment:
requests already holding the old `Loaded` finish on it, new ones get the new one, and a model that fails
to load is refused while the old one keeps serving. Model files are read by the apps' loaders through
safetensors / JSON (`mariana.platform.core.export.load_exported`): no pickle, no code execution.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mariana.platform.core.errors import MarianaError

log = logging.getLogger("mariana.serving")

APPS = ("pctr", "asr", "vision")
# The files whose change means "a new model version was exported" (written atomically by export_model).
MODEL_FILES = ("model.safetensors", "model.json")


def _load_pctr(run_dir: str):
    from mariana.apps.pctr.predict import load_predictor

    return load_predictor(run_dir)


def _load_asr(run_dir: str):
    from mariana.apps.asr.predict import load_transcriber

    return load_transcriber(run_dir)


def _load_vision(run_dir: str):
    from mariana.apps.vision.predict import load_classifier

    return load_classifier(run_dir)


LOADERS: dict[str, Callable[[str], Any]] = {"pctr": _load_pctr, "asr": _load_asr, "vision": _load_vision}
# What each app's inference object must offer; checked at load so a wrong run dir is refused up front.
REQUIRED = {"pctr": ("predict_lines",), "asr": ("transcribe_wav_bytes",), "vision": ("classify_bytes",)}


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


def _file_digest(run_dir: str | Path) -> str:
    p = Path(run_dir)
    f = p / MODEL_FILES[0] if p.is_dir() else p
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:12]


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


def load_model(app: str, run_dir: str | Path, loader: Callable[[str], Any] | None = None) -> Loaded:
    """Load ``app``'s model from ``run_dir``; raises MarianaError (naming the run dir) when it cannot."""
    if app not in LOADERS and loader is None:
        raise MarianaError(f"unknown app {app!r} (expected one of {', '.join(APPS)})")
    run_dir = str(run_dir)
    if not Path(run_dir).exists():
        raise MarianaError(f"--{app} {run_dir}: no such run directory")
    sig = files_signature(run_dir)  # before loading: a change during the load triggers another reload
    try:
        obj = (loader or LOADERS[app])(run_dir)
    except MarianaError as e:
        raise MarianaError(f"--{app} {run_dir}: {e}") from None
    except ModuleNotFoundError as e:
        raise MarianaError(f"--{app}: this build has no {app} inference module ({e.name})") from None
    except Exception as e:  # noqa: BLE001  -- any loader failure means "refuse this model"
        raise MarianaError(f"--{app} {run_dir}: model failed to load: {type(e).__name__}: {e}") from None
    missing = [m for m in REQUIRED.get(app, ()) if not callable(getattr(obj, m, None))]
    if missing:
        raise MarianaError(f"--{app} {run_dir}: loaded object lacks {', '.join(missing)}()")
    version = getattr(obj, "version", None)
    if not isinstance(version, str) or not version:
        version = _file_digest(run_dir)  # content hash: the same weights always give the same version
    return Loaded(app, obj, version, run_dir, sig)


def _warm_up_pctr(obj) -> None:
    """One tiny prediction so the first real request does not pay for lazy initialisation. The warm-up
    record is the model's own format with every field missing; parse errors are fine (nothing to warm)."""
    fmt = getattr(obj, "format", "libfm")
    line = "\t" * 38 if fmt == "criteo" else "0:1"
    try:
        probs, _ = obj.predict_lines([line])
    except Exception:  # noqa: BLE001  -- a record the model rejects warms nothing; not a load failure
        log.debug("pctr warm-up skipped", exc_info=True)
        return
    for p in probs:
        if p is not None and not math.isfinite(float(p)):
            raise MarianaError(f"model answers a non-finite probability ({p}) for a warm-up record")


class ModelSlot:
    """The current model of one app, swapped atomically by `reload`; ``on_change(loaded)`` updates metrics."""

    def __init__(
        self,
        app: str,
        run_dir: str,
        loader: Callable[[str], Any] | None = None,
        on_change: Callable[[Loaded], None] | None = None,
        on_reload: Callable[[str], None] | None = None,
    ):
        self.app, self.loader, self.on_change, self.on_reload = app, loader, on_change, on_reload
        self._reload_lock = threading.Lock()  # one reload at a time; serving never takes it
        self.current: Loaded = self._load(run_dir)
        self._last_failed_sig: tuple | None = None
        if on_change:
            on_change(self.current)

    def _load(self, run_dir: str) -> Loaded:
        loaded = load_model(self.app, run_dir, self.loader)
        if self.app == "pctr":
            _warm_up_pctr(loaded.obj)
        return loaded

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
