"""From flags, presets and TOML files to a validated config, and the flags of a config class.

A resolved config comes from four layers, later ones winning::

    dataclass defaults  <  --preset NAME  <  --config FILE.toml  <  explicit CLI flags

(with ``--resume``, the run's own ``RUN/config.toml`` takes the place of the defaults and the preset).
Values are type-checked against the annotations. A value the user set explicitly (a flag, or a key of the
``--config`` file) in a field that does not apply under the resolved config is refused (`check_applies`).
Standard library only."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

from ..errors import MarianaError
from .fields import _base_type, check_choice, check_choices, coerce, epoch_or, flag, parse_flag
from .files import flatten, load_toml, read_config_values

C = TypeVar("C")

DEPRECATED_FLAT = (
    "{path}: a flat config file (one key per field) is deprecated; put each field under its section's "
    "table, e.g. [optim] then lr = 0.01 (`--help` lists the sections as [name] groups)"
)


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one ``--kebab-case`` flag per field of ``cls`` (bools get ``--x/--no-x``); for a composed
    `Config`, one argument group per section, titled ``[name] title`` (the TOML table it maps to).

    Defaults are suppressed so that only flags the user typed reach `resolve_config` (they must win over
    the preset and the TOML file, and an untyped flag must not)."""
    hints = typing.get_type_hints(cls)
    sections = getattr(cls, "SECTIONS", ())
    groups = {s.NAME: parser.add_argument_group(f"[{s.NAME}] {s.TITLE}") for s in sections}
    for f in fields(cls):
        if f.metadata.get("cli", True):
            target = groups.get(f.metadata.get("section"), parser)
            _add_flag(target, f, hints[f.name], getattr(cls, "CLAUSES", {}).get(f.name, ()))


def _add_flag(target, f: dataclasses.Field, tp: Any, clauses: tuple) -> None:
    help_ = f.metadata.get("help", "")
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    help_ = f"{help_} (default: {default!r})" if default not in ("", None) else help_
    if clauses:
        help_ += "; applies to " + " and ".join(c.text for c in clauses)
    kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_}
    if f.metadata.get("required"):
        kwargs["required"] = True
    if _base_type(tp)[0] is bool:
        target.add_argument(f"--{flag(f.name)}", action=argparse.BooleanOptionalAction, **kwargs)
        return
    metavar = f.name.upper()
    if f.metadata.get("choices"):
        kwargs["choices"] = f.metadata["choices"]
        metavar = "{" + ",".join(str(c) for c in f.metadata["choices"]) + "}"
        if typing.get_origin(_base_type(tp)[0]) is list:  # "a,b": argparse cannot check the parts
            del kwargs["choices"]
    parse = parse_flag(tp)
    if f.metadata.get("epoch_ok"):
        parse, metavar = epoch_or(parse), "{N,epoch}"
    target.add_argument(f"--{flag(f.name)}", type=parse, metavar=metavar, **kwargs)


def absolute_paths(cfg: C) -> C:
    """A copy of ``cfg`` whose ``path=True`` fields hold absolute paths (empty values stay empty)."""
    updates = {}
    for f in fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if f.metadata.get("path") and isinstance(value, str) and value:
            updates[f.name] = os.path.abspath(os.path.expanduser(value))
    return dataclasses.replace(cfg, **updates) if updates else cfg  # type: ignore[type-var]


def apply_values(cfg: C, values: dict[str, Any], source: str) -> C:
    """Return a copy of ``cfg`` with flat ``values`` applied (type-checked; unknown keys rejected)."""
    hints = typing.get_type_hints(type(cfg))
    by_name = {f.name: f for f in fields(cfg)}  # type: ignore[arg-type]
    updates = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in by_name:
            known = ", ".join(sorted(by_name))
            raise MarianaError(f"{source}: unknown field {key!r} (known fields: {known})")
        if value == "epoch" and by_name[name].metadata.get("epoch_ok"):
            value = -1
        updates[name] = coerce(hints[name], value, f"{source}: field {key!r}")
        check_choice(cfg, name, updates[name], f"{source}: field {key!r}")
    return dataclasses.replace(cfg, **updates)  # type: ignore[type-var]


def read_config_file(cls: type, path: str | Path, warn: bool = True) -> dict[str, Any]:
    """A ``--config`` file as flat ``{field: value}`` for ``cls``: sectioned (tables checked against the
    sections) or flat; a flat file of a composed config gets one deprecation line on stderr (``warn``)."""
    values, was_flat = flatten(load_toml(path), cls if getattr(cls, "SECTIONS", ()) else None, str(path))
    if was_flat and warn and getattr(cls, "SECTIONS", ()):
        print("mariana: warning: " + DEPRECATED_FLAT.format(path=path), file=sys.stderr)
    return values


def check_applies(cfg: Any, explicit: dict[str, str]) -> None:
    """Refuse a value set explicitly in a field that does not apply under ``cfg`` (MarianaError: one line,
    e.g. ``--ftrl-l1 applies to --sparse-optimizer ftrl only (this run: --sparse-optimizer adagrad)``).
    ``explicit``: field name -> where the user set it ("" for a flag, the TOML file's path otherwise)."""
    clauses = getattr(type(cfg), "CLAUSES", {})
    for name in [f.name for f in fields(cfg) if f.name in explicit]:
        for clause in clauses.get(name, ()):
            if not clause.test(cfg):
                where = f"{explicit[name]}: field {name!r}: " if explicit[name] else ""
                raise MarianaError(where + clause.refusal(name, cfg))


def resolve_config(cls: type[C], args: argparse.Namespace, presets: dict[str, C] | None = None) -> C:
    """Build the config: defaults < --preset < --config TOML < flags the user typed. Validates it and
    refuses explicit values that do not apply (`check_applies`). With ``--resume``, the run's own
    ``RUN/config.toml`` takes the place of the defaults and the preset, so only what changes needs typing
    (`saved_run_values`). The CLI resolves a command's config before it imports the command's handler
    and keeps it in ``args._resolved``; the handler's own call returns that one."""
    resolved = getattr(args, "_resolved", None)
    if type(resolved) is cls:
        return resolved  # type: ignore[return-value]
    presets = presets or {}
    given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}  # type: ignore[arg-type]
    cfg = cls()
    toml_path = given.get("config") or ""
    toml_values = read_config_file(cls, toml_path) if toml_path else {}
    preset = given.get("preset") or toml_values.get("preset") or ""
    saved = saved_run_values(cls, given, toml_values)
    if saved:
        cfg, preset = apply_values(cfg, saved, "the run's config.toml"), ""
    if preset:
        if preset not in presets:
            raise MarianaError(
                f"unknown preset {preset!r}; choose from: {', '.join(sorted(presets)) or 'none'}"
            )
        cfg = dataclasses.replace(presets[preset])  # type: ignore[type-var]
    if toml_values:
        cfg = apply_values(cfg, toml_values, str(toml_path))
    cfg = dataclasses.replace(cfg, **given)  # type: ignore[type-var]
    check_choices(cfg, f"preset {preset!r}" if preset else "config")
    cfg = absolute_paths(cfg)
    explicit = {k.replace("-", "_"): str(toml_path) for k in toml_values} | {k: "" for k in given}
    check_applies(cfg, explicit)
    if hasattr(cfg, "validate"):
        cfg.validate()  # type: ignore[attr-defined]
    return cfg


def saved_run_values(cls: type, given: dict[str, Any], toml_values: dict[str, Any]) -> dict[str, Any]:
    """With --resume (typed or in the TOML file): the values of ``OUT/config.toml`` (sectioned or flat)
    that ``cls`` has (``{}`` without --resume or without that file), ``resume`` and ``force`` left out."""
    if not (given.get("resume") or toml_values.get("resume")):
        return {}
    out = given.get("out") or toml_values.get("out") or cls().out
    path = Path(out) / "config.toml"
    if not path.is_file():
        return {}
    names = {f.name for f in fields(cls)} - {"resume", "force", "config"}
    return {k: v for k, v in read_config_values(path).items() if k in names}


def applicable_values(
    cls: type, values: dict[str, Any], argv: list[str] | tuple = (), presets: dict | None = None
) -> dict[str, Any]:
    """``values`` (flat ``{field: value}``, e.g. a tuning trial's parameters) less the ones that would not
    apply under ``cls``'s defaults < the preset < the flags in ``argv`` < ``values`` (what `check_applies`
    would refuse), so a search space may span models whose fields differ."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_config_args(parser, cls)
    try:
        given = vars(parser.parse_known_args([str(a) for a in argv])[0])
    except (argparse.ArgumentError, SystemExit):  # the train command reports bad flags itself
        given = {}
    cfg = (presets or {}).get(given.get("preset") or "") or cls()
    cfg = dataclasses.replace(cfg, **given)
    for key, value in values.items():
        try:
            cfg = apply_values(cfg, {key: value}, "parameters")
        except MarianaError:  # e.g. a list given as its flag's text "a,b": the clauses read other fields
            cfg = dataclasses.replace(cfg, **{key.replace("-", "_"): value})
    return {k: v for k, v in values.items() if cfg.applies(k.replace("-", "_"))}
