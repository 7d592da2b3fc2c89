"""Helpers shared by the subcommands of every app: config flags, run-dir set-up, the train entry point."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.config import add_config_args, resolve_config
from ..core.errors import MarianaError
from ..core.rundir import check_resume_config
from ..runtime.launch import in_worker, launch_if_needed
from .outputs import command_of, guard_output, mark_output


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after a flag's help, except for required flags and empty defaults (None, "",
    [], False of a plain flag), where it would only mislead."""

    def _get_help_string(self, action):
        help_ = action.help or ""
        if action.required or action.default in (None, "", [], argparse.SUPPRESS) or "%(default)" in help_:
            return help_
        if action.default is False and action.nargs == 0:
            return help_
        return super()._get_help_string(action)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """{name: parser} of ``parser``'s subcommands ({} for a leaf; an alias names the same parser twice)."""
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def add_command_parser(
    group,
    name: str,
    cfg_cls: type,
    help: str,
    func: Callable,
    presets: dict | None = None,
    description: str | None = None,
) -> argparse.ArgumentParser:
    """A leaf parser whose flags are ``cfg_cls``'s fields, one argument group per section (`add_config_args`);
    the handler gets the config with `resolve_config(*args._config, ...)` (and `check_command` resolves it
    too). ``presets`` (the app's PRESETS dict, optional): their names are listed in ``--preset``'s help (the
    value itself is checked by `resolve_config`, so a preset named in a TOML file is checked the same way)."""
    p = group.add_parser(
        name, help=help, description=description or help, formatter_class=DefaultsHelpFormatter
    )
    add_config_args(p, cfg_cls)
    for action in p._actions:  # an {N,epoch} flag's default -1 is how 'epoch' is stored: show it as typed
        if action.metavar == "{N,epoch}" and action.help:
            action.help = action.help.replace("(default: -1)", "(default: epoch)")
    if presets:
        for action in p._actions:
            if action.dest == "preset":
                names = ", ".join(sorted(presets))
                action.metavar = "{" + ",".join(sorted(presets)) + "}"
                action.help = f"named preset of defaults: {names} (see the app's configs.py)"
    p.set_defaults(func=func, _config=(cfg_cls, presets))
    return p


def add_train_parser(
    group, name: str, cfg_cls: type, help: str, func: Callable, presets: dict | None = None
) -> argparse.ArgumentParser:
    """`add_command_parser` for a training command: its ``--out`` is a run directory."""
    p = add_command_parser(group, name, cfg_cls, help, func, presets)
    mark_output(p, "--out", "run")
    return p


def check_data_path(path: str, what: str = "--data") -> Path:
    if not path:
        raise MarianaError(f"{what} is required")
    p = Path(path)
    if not p.exists():
        raise MarianaError(f"{what} {path}: no such file or directory")
    return p


def check_out_dir(out: str) -> Path:
    """``--out`` must be a directory this user can write: create it now (before any worker starts) and
    fail in one line if that is impossible."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise MarianaError(f"--out {out}: is an existing file, expected a run directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MarianaError(f"--out {out}: cannot create the run directory ({e.strerror or e})") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise MarianaError(f"--out {out}: the run directory is not writable")
    return p


# What a run directory's own files are: removed by --force over a finished run, and (all but config.toml
# and logs) by a restart of an interrupted run that has no checkpoint to resume from.
RUN_FILES = ("checkpoints", "model.safetensors", "model.json", "metrics.json", "metrics.jsonl", "eval")
RUN_FILES += ("tracking.json",)  # the MLflow run / TensorBoard folder (`core/tracking.py`)


def check_fresh_run_dir(cfg: Any, command: str = "") -> None:
    """Checks of ``cfg.out`` before training starts (call it in the launching process, not in workers):
    it is a writable directory (created here) that holds nothing but this command's own run
    (`outputs.guard_output`, ``command`` e.g. "pctr train"; ``--force`` overrides); without --resume it
    holds no finished run (one interrupted before its first checkpoint is started again: its stale
    model and metrics are removed); with --resume it holds a checkpoint and the settings that may not
    change on resume (see ``RESUME_MAY_CHANGE``) are those of its ``RUN/config.toml``."""
    force = bool(getattr(cfg, "force", False))
    if command:
        guard_output(cfg.out, "--out", command, "run", force and not cfg.resume, config_cls=type(cfg))
    out = check_out_dir(cfg.out)
    latest = out / "checkpoints" / "latest"
    finished = latest.exists() or (out / "metrics.json").exists()
    if latest.exists() and int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0:
        cfg.resume = True  # a requeued Slurm job continues from its checkpoint (platform/jobs/README.md)
    if finished and not cfg.resume and not force:
        raise MarianaError(
            f"{cfg.out} already holds a trained run; pass --resume to continue it, --force to train over "
            "it, or choose another --out"
        )
    if not cfg.resume:  # a new run: nothing of an earlier one (finished and --force, or interrupted) is kept
        _remove_run_files(out)
    if cfg.resume:
        if not latest.is_file():
            raise MarianaError(
                f"--resume: no checkpoint in {out / 'checkpoints'} (the run stopped before its first "
                "checkpoint; run the same command without --resume to start it again in the same --out)"
            )
        check_resume_config(cfg, out)
        done = checkpoint_step(latest)
        if getattr(cfg, "max_steps", 0) and done is not None and cfg.max_steps <= done:
            raise MarianaError(
                f"--resume: the run has already done {done} steps and --max-steps is {cfg.max_steps}; "
                "pass a larger --max-steps to train further"
            )


def _remove_run_files(out: Path) -> None:
    for name in RUN_FILES:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def checkpoint_step(latest: Path) -> int | None:
    """The step of the checkpoint ``RUN/checkpoints/latest`` names (``step_00000040`` -> 40), or None."""
    name = latest.read_text().strip()
    digits = name.rpartition("_")[2]
    return int(digits) if digits.isdigit() else None


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
    cfg = resolve_config(cfg_cls, args, presets)
    check_data_path(cfg.data)
    for field in optional_paths:
        if getattr(cfg, field):
            check_data_path(getattr(cfg, field), "--" + field.replace("_", "-"))
    if not in_worker():
        check_fresh_run_dir(cfg, command_of(args)[0])
    from ..core.export import warm_start_note

    rc = launch_if_needed(cfg, argv)
    if rc is not None:
        if rc == 0:
            final = Path(cfg.out) / "metrics.json"
            if final.is_file():
                m = json.loads(final.read_text())
                print(headline(m) + warm_start_note(cfg, m))
        return rc
    final = train_fn(cfg)
    if final is not None and not in_worker():  # under torchrun the launcher prints it once
        print(headline(final) + warm_start_note(cfg, final))
    return 0
