"""Config TOML files: one table per section (``[optim]\\nlr = 0.01``), and the flat files of earlier versions
(one ``key = value`` per field), which are still read. Standard library only (plus the atomic writer)."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_text
from ..errors import MarianaError


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file into a dict; MarianaError naming the file if it is missing, a folder, binary or
    not valid TOML."""
    path = Path(path)
    if path.is_dir():
        raise MarianaError(f"config file {path} is a directory, expected a TOML file")
    if not path.is_file():
        raise MarianaError(f"config file {path} does not exist")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise MarianaError(f"{path}: not a UTF-8 TOML file") from None
    except OSError as e:
        raise MarianaError(f"config file {path} cannot be read: {e.strerror or e}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise MarianaError(f"{path}: not valid TOML: {e}") from None


def flatten(values: dict[str, Any], cls: type | None = None, where: str = "config") -> tuple[dict, bool]:
    """A config file's dict as flat ``{field: value}`` and whether it had top-level fields (the flat,
    deprecated layout). With ``cls`` (a composed `Config`), each table must be one of its sections and hold
    only that section's fields (MarianaError naming ``where``, the table and the field otherwise)."""
    sections = {s.NAME: s for s in getattr(cls, "SECTIONS", ())}
    section_of = getattr(cls, "SECTION_OF", {})
    flat: dict[str, Any] = {}
    had_flat = False
    for key, value in values.items():
        if not isinstance(value, dict):
            flat[key], had_flat = value, True
            continue
        if cls is not None and key not in sections:
            raise MarianaError(
                f"{where}: unknown section [{key}] (this command's sections: {', '.join(sections) or 'none'})"
            )
        for name, v in value.items():
            field = name.replace("-", "_")
            home = section_of.get(field)
            if cls is not None and home is not None and home != key:
                raise MarianaError(f"{where}: field {name!r} belongs in section [{home}], not [{key}]")
            flat[name] = v
    return flat, had_flat


def read_config_values(path: str | Path) -> dict[str, Any]:
    """A run's ``config.toml`` (sectioned or, from earlier versions, flat) as flat ``{field: value}``."""
    return flatten(load_toml(path), None, str(path))[0]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def to_toml(values: dict[str, Any]) -> str:
    """Flat dict -> TOML text (None values are omitted: TOML has no null)."""
    return "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items() if v is not None)


def sectioned_toml(cls: type, values: dict[str, Any]) -> str:
    """Flat ``{field: value}`` of composed config ``cls`` -> TOML text with one table per section (in the
    composition's order; fields ``cls`` lacks are dropped; None values omitted)."""
    parts = []
    for s in getattr(cls, "SECTIONS", ()):
        body = {f.name: values[f.name] for f in dataclasses.fields(s) if f.name in values}
        text = to_toml(body)
        if text:
            parts.append(f"[{s.NAME}]\n{text}")
    return "\n".join(parts)


def config_toml(cfg: Any) -> str:
    """A resolved config as TOML: a composed `Config` by sections, with only the fields that apply under
    its values (what the run used); any other dataclass flat."""
    values = dataclasses.asdict(cfg)
    if not getattr(type(cfg), "SECTIONS", ()):
        return to_toml(values)
    return sectioned_toml(type(cfg), {k: v for k, v in values.items() if cfg.applies(k)})


def save_config(cfg: Any, path: str | Path) -> None:
    """Write ``cfg`` to ``path`` atomically (`config_toml`)."""
    atomic_write_text(path, config_toml(cfg))
