"""Typed job configs: dataclasses, TOML files and CLI flags.

Every job has one flat dataclass (apps inherit `TrainConfig` and add their own fields). A resolved config
comes from four layers, later ones winning::

    dataclass defaults  <  --preset NAME  <  --config FILE.toml  <  explicit CLI flags

Values from TOML and flags are type-checked against the dataclass annotations; a mismatch raises
`MarianaError` naming the file and field. The resolved config is saved as ``RUN/config.toml``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tomllib
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from .errors import MarianaError

C = TypeVar("C")


def opt(
    default: Any,
    help: str,
    choices: typing.Sequence[Any] | None = None,
    cli: bool = True,
    path: bool = False,
    epoch_ok: bool = False,
):
    """A config field with a help string (shown by ``--help``) and optional allowed values.

    ``choices``: the allowed values, enforced for flags, TOML files and presets alike (`check_choices`).
    ``path=True``: a file-system path; `resolve_config` makes a non-empty value absolute, so
    ``RUN/config.toml`` names the same files whatever directory a later command runs in.
    ``epoch_ok=True``: an int field that also takes the word ``epoch`` (stored as -1)."""
    meta = {
        "help": help,
        "choices": tuple(choices) if choices else None,
        "cli": cli,
        "path": path,
        "epoch_ok": epoch_ok,
    }
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """Fields every training job shares. Apps subclass this and add their own (flat) fields.

    ``RESUME_MAY_CHANGE``: the fields a ``--resume`` may give other values than the checkpoint's
    ``RUN/config.toml`` (they change neither the model, nor the data order, nor optimizer state that the
    checkpoint restores); any other difference is refused. A subclass extends it:
    ``RESUME_MAY_CHANGE = TrainConfig.RESUME_MAY_CHANGE | {"eval_data"}``."""

    RESUME_MAY_CHANGE: typing.ClassVar[frozenset[str]] = frozenset(
        {
            "out", "config", "preset", "resume", "force",  # where the run is and how the values were given
            "epochs", "max_steps",  # how long to train (the LR schedule follows the new length)
            "log_every", "eval_every", "ckpt_every", "progress",  # reporting
            "early_stop", "init_from",  # when to stop; the warm start only matters before the first step
            "timeout", "max_restarts", "rdzv_endpoint", "rdzv_id",  # fault handling and rendezvous
            "device", "amp", "grad_comm", "num_workers",  # where and how fast, not what
        }
    )  # fmt: skip
    # The metrics the app's evaluation reports (without eval_/val_): --monitor is checked against them
    # before any worker starts (empty: only the name's direction is checked)
    EVAL_METRICS: typing.ClassVar[tuple[str, ...]] = ()

    data: str = opt("", "training data path (file or folder; see the app's docs for the layout)", path=True)
    out: str = opt(
        "runs/run", "run directory to create (config.toml, checkpoints/, metrics.jsonl, ...)", path=True
    )
    config: str = opt(
        "", "TOML file with config values (flags given on the command line override it)", path=True
    )
    preset: str = opt("", "named preset of defaults (e.g. debug, small); see the app's configs.py")
    device: str = opt("auto", "compute device: auto picks cuda when available", ["auto", "cpu", "cuda"])
    workers: int = opt(1, "data-parallel worker processes on this node (launched through torchrun)")
    nnodes: int = opt(1, "number of nodes (multi-node runs rendezvous at --rdzv-endpoint)")
    rdzv_endpoint: str = opt("", "host:port of the c10d rendezvous for multi-node runs")
    rdzv_id: str = opt("mariana", "rendezvous id shared by all nodes of one job")
    max_restarts: int = opt(0, "torchrun restarts of failed workers; they resume from the last checkpoint")
    timeout: float = opt(300.0, "collective timeout in seconds: a rank that stalls longer fails the job")
    grad_comm: str = opt(
        "fp32", "gradient all-reduce precision (bf16/fp16 halve the bytes)", ["fp32", "bf16", "fp16"]
    )
    epochs: int = opt(1, "passes over the training data (ignored when --max-steps > 0)")
    max_steps: int = opt(0, "optimizer steps to run; 0 means --epochs full passes")
    batch_size: int = opt(
        64, "samples per worker per micro-step (global batch = workers x this x grad-accum)"
    )
    lr: float = opt(1e-3, "peak learning rate")
    weight_decay: float = opt(0.0, "decoupled weight decay")
    optimizer: str = opt("adamw", "optimizer", ["sgd", "adam", "adamw"])
    momentum: float = opt(0.9, "SGD momentum")
    schedule: str = opt("constant", "learning-rate schedule after warm-up", ["constant", "cosine", "linear"])
    warmup_steps: int = opt(0, "linear warm-up steps")
    clip_grad: float = opt(0.0, "clip the global gradient norm to this value; 0 disables")
    grad_accum: int = opt(1, "micro-steps accumulated per optimizer step")
    log_every: int = opt(10, "optimizer steps between metrics.jsonl records")
    eval_every: int = opt(
        0,
        "evaluate every N optimizer steps, or 'epoch' at the end of every epoch; 0 only at the end",
        epoch_ok=True,
    )
    monitor: str = opt(
        "",
        "evaluation metric that picks the best model and drives --early-stop (e.g. auc, logloss, wer, top1; "
        "its direction is known); empty: the app's headline metric",
    )
    early_stop: int = opt(
        0, "stop after this many evaluations in a row without a better --monitor value; 0 never stops early"
    )
    init_from: str = opt(
        "",
        "warm start: initial weights from a run directory or model.safetensors (not --resume: a new run "
        "with fresh optimizer state and schedule)",
        path=True,
    )
    ckpt_every: int = opt(0, "optimizer steps between checkpoints; 0 checkpoints only at the end")
    seed: int = opt(0, "random seed (model init, shuffling, augmentation)")
    resume: bool = opt(False, "continue from the last checkpoint in --out")
    force: bool = opt(
        False,
        "train into an --out that holds data this command did not create, or over a finished run (its "
        "checkpoints, model and metrics are removed first)",
    )
    amp: str = opt(
        "auto", "mixed precision: auto = bf16 autocast on GPU, off on CPU", ["auto", "bf16", "off"]
    )
    num_workers: int = opt(0, "data-loader worker processes per training process")
    progress: bool = opt(True, "show a progress bar on rank 0")

    def validate(self) -> None:
        """Cross-field checks; raise MarianaError. Subclasses extend (call super().validate())."""
        for name in ("workers", "nnodes", "epochs", "batch_size", "grad_accum", "log_every"):
            if getattr(self, name) < 1:
                raise MarianaError(f"--{_flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.eval_every < -1:
            raise MarianaError(
                f"--eval-every must be a number of steps >= 0 or 'epoch', got {self.eval_every}"
            )
        for name in ("max_steps", "ckpt_every", "max_restarts", "num_workers", "warmup_steps", "early_stop"):
            if getattr(self, name) < 0:
                raise MarianaError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "weight_decay", "clip_grad", "momentum"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise MarianaError(f"--{_flag(name)} must be a finite number >= 0, got {value}")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise MarianaError(f"--timeout must be > 0 seconds, got {self.timeout}")
        if self.monitor:
            from .evaluator import higher_is_better, metric_name

            higher_is_better(self.monitor)  # an unknown metric name is refused before any worker starts
            reported = type(self).EVAL_METRICS
            if reported and metric_name(self.monitor) not in reported:
                raise MarianaError(
                    f"--monitor {self.monitor}: the evaluation reports no such metric (this job's "
                    f"evaluation reports: {', '.join(reported)})"
                )
        if self.init_from and not os.path.exists(self.init_from):
            raise MarianaError(f"--init-from {self.init_from}: no such run directory or model file")
        if self.optimizer != "sgd" and self.momentum != 0.9:
            raise MarianaError(f"--momentum applies to --optimizer sgd only (this job uses {self.optimizer})")
        if self.rdzv_endpoint:
            from ..runtime.endpoint import check_endpoint

            check_endpoint(self.rdzv_endpoint)
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise MarianaError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


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


def _parse_flag(tp: Any, flag: str):
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


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one ``--kebab-case`` flag per dataclass field (bools get ``--x/--no-x``).

    Defaults are suppressed so that only flags the user typed reach `resolve_config` (they must win over
    the preset and the TOML file, and an untyped flag must not)."""
    hints = _hints(cls)
    for f in fields(cls):
        if not f.metadata.get("cli", True):
            continue
        tp = hints[f.name]
        help_ = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_ = f"{help_} (default: {default!r})" if default not in ("", None) else help_
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_}
        if _base_type(tp)[0] is bool:
            parser.add_argument(f"--{_flag(f.name)}", action=argparse.BooleanOptionalAction, **kwargs)
            continue
        metavar = f.name.upper()
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
            metavar = "{" + ",".join(str(c) for c in f.metadata["choices"]) + "}"
            if typing.get_origin(_base_type(tp)[0]) is list:  # "a,b": argparse cannot check the parts
                del kwargs["choices"]
        parse = _parse_flag(tp, f.name)
        if f.metadata.get("epoch_ok"):
            parse, metavar = _epoch_or(parse), "{N,epoch}"
        parser.add_argument(f"--{_flag(f.name)}", type=parse, metavar=metavar, **kwargs)


def _epoch_or(parse):
    def parse_epoch(text: str):
        return -1 if text.strip().lower() == "epoch" else parse(text)

    parse_epoch.__name__ = "int or 'epoch'"
    return parse_epoch


def _field(cls_or_cfg: Any, name: str) -> dataclasses.Field:
    return {f.name: f for f in fields(cls_or_cfg)}[name]


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


def _choices_text(choices: typing.Sequence[Any]) -> str:
    return ", ".join(str(c) for c in choices)


def check_choice(cls_or_cfg: Any, name: str, value: Any, where: str) -> None:
    """MarianaError ``<where>: expected one of a, b, c, got 'x'`` if ``name`` has choices and ``value``
    (or, for a list field, one of its elements) is not one of them."""
    f = {f.name: f for f in fields(cls_or_cfg)}.get(name)
    choices = f.metadata.get("choices") if f is not None else None
    if not choices:
        return
    for v in value if isinstance(value, list) else [value]:
        if v not in choices:
            raise MarianaError(f"{where}: expected one of {_choices_text(choices)}, got {v!r}")


def check_choices(cfg: Any, source: str = "config") -> None:
    """Every field with ``choices`` holds one of them (after presets, TOML and flags are merged)."""
    for f in fields(cfg):
        check_choice(cfg, f.name, getattr(cfg, f.name), f"{source}: field {f.name!r}")


def absolute_paths(cfg: C) -> C:
    """A copy of ``cfg`` whose ``path=True`` fields hold absolute paths (empty values stay empty)."""
    updates = {}
    for f in fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if f.metadata.get("path") and isinstance(value, str) and value:
            updates[f.name] = os.path.abspath(os.path.expanduser(value))
    return dataclasses.replace(cfg, **updates) if updates else cfg  # type: ignore[type-var]


def apply_values(cfg: C, values: dict[str, Any], source: str) -> C:
    """Return a copy of ``cfg`` with ``values`` applied (type-checked; unknown keys rejected)."""
    hints = _hints(type(cfg))
    known = {f.name for f in fields(cfg)}  # type: ignore[arg-type]
    updates = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in known:
            raise MarianaError(f"{source}: unknown field {key!r} (known fields: {', '.join(sorted(known))})")
        if value == "epoch" and _field(cfg, name).metadata.get("epoch_ok"):
            value = -1
        updates[name] = coerce(hints[name], value, f"{source}: field {key!r}")
        check_choice(cfg, name, updates[name], f"{source}: field {key!r}")
    return dataclasses.replace(cfg, **updates)  # type: ignore[type-var]


def resolve_config(cls: type[C], args: argparse.Namespace, presets: dict[str, C] | None = None) -> C:
    """Build the config: defaults < --preset < --config TOML < flags the user typed. Validates it.
    With ``--resume``, the run's own ``RUN/config.toml`` takes the place of the defaults and the preset,
    so only what changes needs typing (`saved_run_values`)."""
    presets = presets or {}
    given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}  # type: ignore[arg-type]
    cfg = cls()
    toml_path = given.get("config") or ""
    toml_values = load_toml(toml_path) if toml_path else {}
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
    if hasattr(cfg, "validate"):
        cfg.validate()  # type: ignore[attr-defined]
    return cfg


def saved_run_values(cls: type, given: dict[str, Any], toml_values: dict[str, Any]) -> dict[str, Any]:
    """With --resume (typed or in the TOML file): the values of ``OUT/config.toml`` that ``cls`` has
    (``{}`` without --resume or without that file), ``resume`` and ``force`` left out."""
    if not (given.get("resume") or toml_values.get("resume")):
        return {}
    out = given.get("out") or toml_values.get("out") or cls().out
    path = Path(out) / "config.toml"
    if not path.is_file():
        return {}
    names = {f.name for f in fields(cls)} - {"resume", "force", "config"}
    return {k: v for k, v in load_toml(path).items() if k in names}


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


def save_config(cfg: Any, path: str | Path) -> None:
    from .atomic import atomic_write_text

    atomic_write_text(path, to_toml(dataclasses.asdict(cfg)))


def load_config(cls: type[C], path: str | Path) -> C:
    """Read a config saved by `save_config` (e.g. ``RUN/config.toml``) back into ``cls``."""
    return apply_values(cls(), load_toml(path), str(path))
