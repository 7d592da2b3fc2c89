"""Config fields: `opt` (a dataclass field with its flag's help, choices and when it applies), the
applies-conditions (`only`, `not_with`, `at_least`, `given`, `when`) and the type checks shared by flags and
TOML files. Standard library only."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import MarianaError


def flag(name: str) -> str:
    """``batch_size`` -> ``batch-size`` (a field's flag is ``--`` + this)."""
    return name.replace("_", "-")


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


@dataclass(frozen=True)
class Clause:
    """One condition under which a field applies, as a function of the whole resolved config.

    ``field``: the field it reads (asserted to exist in every composition that uses it); ``test(cfg)``:
    whether the field guarded by the clause is used; ``text``: how the refusal names it (``"--sparse-optimizer
    ftrl only"`` -> ``--ftrl-l1 applies to --sparse-optimizer ftrl only``); ``on``/``off``: values of
    ``field`` under which it holds / fails (tests generated from the parser set them; ``None`` for ``on``
    of a path field means "an existing path"); ``also``: ``(field, value)`` pairs a valid config needs
    beside ``on`` (e.g. ``--image-features`` needs ``--image-field`` and ``--images``)."""

    field: str
    test: Callable[[Any], bool]
    text: str
    on: Any
    off: Any
    also: tuple[tuple[str, Any], ...] = ()
    # the field is a data folder the test looks into; on/off: files in it (tests build both folders)
    layout: bool = False

    def refusal(self, name: str, cfg: Any) -> str:
        """The one-line error for an explicitly set field ``name`` that this clause says is not used."""
        now = getattr(cfg, self.field)
        this = (
            f"this run has no --{flag(self.field)}"
            if now in ("", None) or now is False
            else f"this run: --{flag(self.field)} {_shown(now)}"
        )
        given = getattr(cfg, name, None)
        typed = f"--no-{flag(name)}" if given is False else f"--{flag(name)}"  # the form of a switch typed
        return f"{typed} applies to {self.text} ({this})"


def only(field: str, *values: Any) -> Clause:
    """Applies only while ``field`` holds one of ``values`` (e.g. ``only("optimizer", "sgd")``)."""
    text = f"--{flag(field)} {'/'.join(_shown(v) for v in values)} only"
    return Clause(field, lambda cfg: getattr(cfg, field) in values, text, values[0], _OTHER)


def not_with(field: str, *values: Any) -> Clause:
    """Applies unless ``field`` holds one of ``values`` (e.g. ``not_with("model", "lr")``)."""
    text = f"any --{flag(field)} but {'/'.join(_shown(v) for v in values)}"
    return Clause(field, lambda cfg: getattr(cfg, field) not in values, text, _OTHER, values[0])


def at_least(field: str, low: int, **also: Any) -> Clause:
    """Applies only while the number ``field`` is >= ``low`` (e.g. ``at_least("servers", 1)``); ``also``:
    see `Clause`."""
    text = f"--{flag(field)} >= {low} only"
    return Clause(field, lambda cfg: getattr(cfg, field) >= low, text, low, low - 1, tuple(also.items()))


def given(field: str, example: Any = None, **also: Any) -> Clause:
    """Applies only while ``field`` is set (a non-empty path or string, or a true switch). ``example``: a
    valid value of ``field`` (None: an existing path); ``also``: the values a valid config needs beside
    it (see `Clause`)."""
    text = f"runs with --{flag(field)} only"

    def test(cfg: Any) -> bool:
        return bool(getattr(cfg, field))

    return Clause(field, test, text, example, "", tuple(also.items()))


def when(field: str, test: Callable[[Any], bool], text: str, on: Any, off: Any) -> Clause:
    """Any other condition: ``test(cfg)`` reads ``field`` (and may read more); ``on``/``off`` are values of
    ``field`` under which it holds / fails with the other fields at their defaults."""
    return Clause(field, test, text, on, off)


# Placeholder for "the run has validation data": each composition says what that means from its own
# fields or data (``VALIDATION``: a tuple of clauses; none: it always validates); `sections._compose`
# puts those clauses where a field declares this one.
VALIDATES = Clause("", lambda cfg: True, "runs with validation data", None, None)


class _Other:
    """Placeholder witness: any allowed value of the field other than the listed ones (from its choices)."""

    def __repr__(self) -> str:
        return "<another value>"


_OTHER = _Other()


def opt(
    default: Any,
    help: str,
    choices: typing.Sequence[Any] | None = None,
    cli: bool = True,
    path: bool = False,
    epoch_ok: bool = False,
    applies: Clause | tuple[Clause, ...] = (),
    required: bool = False,
):
    """A config field with a help string (shown by ``--help``) and optional allowed values.

    ``choices``: the allowed values, enforced for flags, TOML files and presets alike (`check_choices`).
    ``path=True``: a file-system path; `resolve_config` makes a non-empty value absolute, so
    ``RUN/config.toml`` names the same files whatever directory a later command runs in.
    ``epoch_ok=True``: an int field that also takes the word ``epoch`` (stored as -1).
    ``cli=False``: no flag (a TOML/preset-only value).
    ``applies``: clause(s) that must all hold for the field to be used; a value the user sets explicitly
    (flag or TOML) while one fails is refused (`resolve.check_applies`).
    ``required=True``: the flag must be given (argparse's own error otherwise)."""
    meta = {
        "help": help,
        "choices": tuple(choices) if choices else None,
        "cli": cli,
        "path": path,
        "epoch_ok": epoch_ok,
        "applies": applies if isinstance(applies, tuple) else (applies,),
        "required": required,
    }
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(inner type, optional?) for ``X`` or ``X | None``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _base_type(tp)
    name = getattr(inner, "__name__", str(inner))
    if typing.get_origin(inner) is list:
        name = f"list of {_type_name(typing.get_args(inner)[0])}"
    return f"{name} or none" if optional else name


def coerce(tp: Any, value: Any, where: str) -> Any:
    """Check/convert a TOML or JSON value to the annotated type; MarianaError naming ``where`` if wrong."""
    inner, optional = _base_type(tp)
    if value is None:
        if optional:
            return None
        raise MarianaError(f"{where}: expected {_type_name(tp)}, got nothing")
    ok = False
    if inner is bool:
        ok = isinstance(value, bool)
    elif inner is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif inner is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif inner is str:
        ok = isinstance(value, str)
    elif typing.get_origin(inner) is list:
        if isinstance(value, list):
            (elem,) = typing.get_args(inner)
            return [coerce(elem, v, f"{where}[{i}]") for i, v in enumerate(value)]
    else:  # pragma: no cover - a config author used an unsupported annotation
        raise TypeError(f"unsupported config type {tp!r} at {where}")
    if not ok:
        raise MarianaError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def parse_flag(tp: Any):
    """An argparse ``type=`` callable for a field type, with a clear message on failure."""
    inner, optional = _base_type(tp)

    def parse(text: str):
        if optional and text.lower() in ("none", "null", ""):
            return None
        try:
            if typing.get_origin(inner) is list:
                (elem,) = typing.get_args(inner)
                return [elem(t) for t in text.split(",") if t != ""]
            return inner(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {_type_name(tp)}, got {text!r}") from None

    parse.__name__ = _type_name(tp)
    return parse


def epoch_or(parse):
    """``parse`` that also takes the word ``epoch`` (-1)."""

    def parse_epoch(text: str):
        return -1 if text.strip().lower() == "epoch" else parse(text)

    parse_epoch.__name__ = "int or 'epoch'"
    return parse_epoch


def _choices_text(choices: typing.Sequence[Any]) -> str:
    return ", ".join(str(c) for c in choices)


def check_choice(cls_or_cfg: Any, name: str, value: Any, where: str) -> None:
    """MarianaError ``<where>: expected one of a, b, c, got 'x'`` if ``name`` has choices and ``value``
    (or, for a list field, one of its elements) is not one of them."""
    f = {f.name: f for f in dataclasses.fields(cls_or_cfg)}.get(name)
    choices = f.metadata.get("choices") if f is not None else None
    if not choices:
        return
    for v in value if isinstance(value, list) else [value]:
        if v is not None and v not in choices:  # None: an optional field left unset
            raise MarianaError(f"{where}: expected one of {_choices_text(choices)}, got {v!r}")


def check_choices(cfg: Any, source: str = "config") -> None:
    """Every field with ``choices`` holds one of them (after presets, TOML and flags are merged)."""
    for f in dataclasses.fields(cfg):
        check_choice(cfg, f.name, getattr(cfg, f.name), f"{source}: field {f.name!r}")
