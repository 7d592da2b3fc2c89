"""Helpers shared by the subcommands of every app: config flags, run-dir set-up, the train entry point."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.config import add_config_args, resolve_config
from ..core.errors import MarianaError


def add_train_parser(group, name: str, cfg_cls: type, help: str, func: Callable) -> argparse.ArgumentParser:
    """A ``train`` leaf parser whose flags are ``cfg_cls``'s fields."""
    p = group.add_parser(
        name, help=help, description=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_config_args(p, cfg_cls)
    p.set_defaults(func=func)
    return p


def check_data_path(path: str, what: str = "--data") -> Path:
    if not path:
        raise MarianaError(f"{what} is required")
    p = Path(path)
    if not p.exists():
        raise MarianaError(f"{what} {path}: no such file or directory")
    return p


def check_fresh_run_dir(cfg: Any) -> None:
    """Refuse to train over an existing run's checkpoints unless --resume (nothing trained is lost)."""
    latest = Path(cfg.out) / "checkpoints" / "latest"
    if latest.exists() and not cfg.resume:
        raise MarianaError(
            f"{cfg.out} already holds a trained run; pass --resume to continue it or choose another --out"
        )


def run_training(
    args,
    argv,
    cfg_cls: type,
    presets: dict,
    train_fn: Callable[[Any], dict],
    headline: Callable[[dict], str],
    optional_paths: tuple[str, ...] = (),
) -> int:
    """The thin train entry point: resolve config, check its data paths, launch workers if needed, train,
    print the headline. ``cfg.data`` must exist; each field named in ``optional_paths`` (e.g. ``eval_data``)
    must exist when set. Checked before any worker starts, so a typo fails in one clear line."""
    from ..dp.launch import in_worker, launch_if_needed

    cfg = resolve_config(cfg_cls, args, presets)
    check_data_path(cfg.data)
    for field in optional_paths:
        if getattr(cfg, field):
            check_data_path(getattr(cfg, field), "--" + field.replace("_", "-"))
    if not in_worker():
        check_fresh_run_dir(cfg)
    rc = launch_if_needed(cfg, argv)
    if rc is not None:
        if rc == 0:
            final = Path(cfg.out) / "metrics.json"
            if final.is_file():
                import json

                print(headline(json.loads(final.read_text())))
        return rc
    final = train_fn(cfg)
    if final is not None and not in_worker():  # under torchrun the launcher prints it once
        print(headline(final))
    return 0
