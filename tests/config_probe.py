"""Test helpers: witness values for a config's `when` clauses (a value under which a clause holds and one
under which it fails), so tests can drive each clause both ways; a field's default; a saved config read back."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mariana.platform.core.config import read_config_values
from mariana.platform.core.config.fields import _OTHER, Clause
from mariana.platform.core.config.resolve import apply_values


def default_of(f: dataclasses.Field) -> Any:
    """A field's default value (calling its factory)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def load_config(cls: type, path: str | Path):
    """A config saved by `save_config` (e.g. ``RUN/config.toml``, sectioned or flat) read back into ``cls``;
    keys ``cls`` does not have (fields an earlier version declared) are ignored."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in read_config_values(path).items() if k in names}
    return apply_values(cls(), values, str(path))


def witnesses(cls: type, clause: Clause, tmp: Path | None = None) -> tuple[Any, Any]:
    """(a value of ``clause.field`` under which the clause holds, one under which it fails), with the
    "another value" placeholders resolved from the field's choices (or a bool's other value). ``None`` for
    the holding value of a `given` clause: the caller supplies a value (e.g. an existing path). A clause
    that looks into a data folder (``clause.layout``) gets two folders made under ``tmp``, holding its
    ``on`` / ``off`` files."""
    if clause.layout:
        assert tmp is not None, f"--{clause.field}: a data-folder condition needs a folder to build in"
        return _folder(Path(tmp) / "holds", clause.on), _folder(Path(tmp) / "fails", clause.off)
    f = {f.name: f for f in dataclasses.fields(cls)}[clause.field]
    out = []
    for v, holds in ((clause.on, True), (clause.off, False)):
        if isinstance(default_of(f), bool) and v in (None, ""):  # `given` of a switch: on / off
            v = holds
        if v is _OTHER:
            candidates = f.metadata.get("choices") or _neighbours(default_of(f), clause)
            v = next(c for c in candidates if clause.test(_Probe(cls, clause.field, c)) == holds)
        out.append(v)
    return out[0], out[1]


def _folder(root: Path, files: tuple[str, ...]) -> str:
    """``root`` holding each of ``files`` (one line each), as a string path."""
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x\n")
    return str(root)


def _neighbours(default: Any, clause: Clause) -> tuple:
    """Values to try for a field without choices: a switch's two, or numbers next to the listed one."""
    if isinstance(default, bool):
        return (True, False)
    known = clause.off if clause.on is _OTHER else clause.on
    return (known + 1, known - 1) if isinstance(known, int | float) else ()


class _Probe:
    """A stand-in config for evaluating one clause with ``field = value`` and every other field at its
    composition default."""

    def __init__(self, cls: type, field: str, value: Any):
        self._defaults = {f.name: default_of(f) for f in dataclasses.fields(cls)}
        self._defaults[field] = value
        self._cls = cls

    def __getattr__(self, name: str) -> Any:
        if name in self._defaults:
            return self._defaults[name]
        return getattr(self._cls, name)
