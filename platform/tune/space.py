"""Search-space files: ``load_space(path, config_cls) -> Space``.

The format (TOML ``[params.NAME]`` float/int/categorical, ``[fixed]``): platform/tune/README.md.
Keys are config field names (``batch_size`` or ``batch-size``). Every key is checked against the app's train
config (unknown field, wrong type, invalid range): a `MarianaError` naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mariana.platform.core.config import _base_type, check_choice, coerce, load_toml
from mariana.platform.core.errors import MarianaError

from .apps import RESERVED

KINDS = ("float", "int", "categorical")


@dataclass
class Param:
    name: str  # config field name
    type: str  # float | int | categorical
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: list[Any] = field(default_factory=list)

    def suggest(self, trial) -> Any:
        """Ask an Optuna trial for this parameter's value."""
        if self.type == "float":
            return trial.suggest_float(self.name, self.low, self.high, log=self.log, step=self.step)
        if self.type == "int":
            return trial.suggest_int(self.name, self.low, self.high, log=self.log, step=self.step or 1)
        return trial.suggest_categorical(self.name, self.choices)


@dataclass
class Space:
    path: str
    params: dict[str, Param]
    fixed: dict[str, Any]


def _field_types(config_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(config_cls)
    # Fields without a flag (cli=False: e.g. options an app does not use) cannot be tuned either.
    return {f.name: hints[f.name] for f in dataclasses.fields(config_cls) if f.metadata.get("cli", True)}


def _known(name: str, types: dict[str, Any], where: str) -> str:
    field_name = name.replace("-", "_")
    if field_name not in types:
        raise MarianaError(
            f"{where}: unknown training flag --{name.replace('_', '-')} (not a field of the app's train config)"
        )
    if field_name in RESERVED:
        raise MarianaError(
            f"{where}: --{field_name} is set by the tuner (give --data on the command line; --out is per trial)"
        )
    return field_name


def _number(spec: dict, key: str, where: str, integer: bool) -> float | int:
    v = spec.get(key)
    ok = isinstance(v, int) if integer else isinstance(v, int | float)
    if isinstance(v, bool) or not ok or (isinstance(v, float) and not math.isfinite(v)):
        kind = "an integer" if integer else "a finite number"
        raise MarianaError(f"{where}: '{key}' must be {kind}, got {v!r}")
    return v


def _param(name: str, spec: Any, types: dict[str, Any], config_cls: type, where: str) -> Param:
    if not isinstance(spec, dict):
        raise MarianaError(f"{where}: expected a table with type = float|int|categorical")
    fname = _known(name, types, where)
    kind = spec.get("type")
    if kind not in KINDS:
        raise MarianaError(f"{where}: 'type' must be one of {', '.join(KINDS)}, got {kind!r}")
    allowed = {"type", "low", "high", "log", "step"} if kind != "categorical" else {"type", "choices"}
    extra = sorted(set(spec) - allowed)
    if extra:
        raise MarianaError(
            f"{where}: unexpected key {extra[0]!r} for type {kind!r} (allowed: {', '.join(sorted(allowed))})"
        )
    base = _base_type(types[fname])[0]
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise MarianaError(f"{where}: 'choices' must be a non-empty list")
        if len({repr(c) for c in choices}) != len(choices):
            raise MarianaError(f"{where}: 'choices' has duplicates")
        for i, c in enumerate(choices):
            if isinstance(c, list | dict):
                raise MarianaError(
                    f'{where}: choices[{i}]: expected a string, number or boolean (write lists as "a,b")'
                )
            value = c
            if typing.get_origin(base) is list and isinstance(c, str):  # "0.9,1.1" for a list field
                value = [typing.get_args(base)[0](x) for x in c.split(",") if x] if c else []
            coerce(types[fname], value, f"{where}: choices[{i}]")
            check_choice(config_cls, fname, value, f"{where}: choices[{i}]")
        return Param(fname, kind, choices=list(choices))
    integer = kind == "int"
    if base not in ((int, float) if integer else (float,)):
        flag, takes = fname.replace("_", "-"), getattr(base, "__name__", base)
        raise MarianaError(f"{where}: --{flag} takes {takes}, not {'an int' if integer else 'a float'} range")
    low, high = _number(spec, "low", where, integer), _number(spec, "high", where, integer)
    if low > high:
        raise MarianaError(f"{where}: low ({low}) must be <= high ({high})")
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise MarianaError(f"{where}: 'log' must be true or false, got {log!r}")
    if log and low <= 0:
        raise MarianaError(f"{where}: log = true needs low > 0, got {low}")
    step = spec.get("step")
    if step is not None:
        step = _number(spec, "step", where, integer)
        if step <= 0:
            raise MarianaError(f"{where}: 'step' must be > 0, got {step}")
        if log:
            raise MarianaError(f"{where}: 'step' and log = true cannot be combined")
    return Param(fname, kind, low, high, log, step)


def load_space(path: str | Path, config_cls: type) -> Space:
    """Parse and validate a space file against ``config_cls`` (the app's train config dataclass)."""
    data = load_toml(path)
    types = _field_types(config_cls)
    unknown = sorted(set(data) - {"params", "fixed"})
    if unknown:
        raise MarianaError(f"{path}: unknown table {unknown[0]!r} (expected [params.NAME] and [fixed])")
    raw_params, raw_fixed = data.get("params", {}), data.get("fixed", {})
    if not isinstance(raw_params, dict) or not raw_params:
        raise MarianaError(f"{path}: no [params.NAME] tables: nothing to search")
    if not isinstance(raw_fixed, dict):
        raise MarianaError(f"{path}: [fixed] must be a table of flag = value")
    params = {}
    for name, spec in raw_params.items():
        p = _param(name, spec, types, config_cls, f"{path}: params.{name}")
        params[p.name] = p
    fixed = {}
    for name, value in raw_fixed.items():
        where = f"{path}: fixed.{name}"
        fname = _known(name, types, where)
        if fname in params:
            raise MarianaError(f"{where}: also searched in [params.{name}]")
        fixed[fname] = coerce(types[fname], value, where)
        check_choice(config_cls, fname, fixed[fname], where)
    return Space(str(path), params, fixed)


def flag_args(values: dict[str, Any]) -> list[str]:
    """Config values -> ``mariana <app> train`` flags (``--batch-size 256``, ``--no-shuffle``, lists as a,b)."""
    out: list[str] = []
    for name, v in values.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + name.replace("_", "-"))
        elif isinstance(v, list):
            out += [flag, ",".join(str(x) for x in v)]
        else:
            out += [flag, str(v)]
    return out
