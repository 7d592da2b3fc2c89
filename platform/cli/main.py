"""The ``mariana`` command: one entry point with a subcommand group per application.

The applications come from the registry (`mariana.platform.core.registry`: each app's ``AppSpec.cli``),
followed by the platform's own commands. Each command module provides ``register(subparsers)``; leaf
parsers set ``func(args, argv) -> int``. Modules import only the standard library at import time, so
``mariana --help`` is fast.
A `MarianaError` (bad flag value, bad config file, missing data) prints one line and exits with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from importlib.metadata import PackageNotFoundError, version

from ..core.config import resolve_config
from ..core.errors import MarianaError
from ..core.registry import all_apps
from ..runtime.workerio import WorkerIO
from .common import DefaultsHelpFormatter, subcommands
from .outputs import command_of, guard_output, guard_parsed, mark_made

# The platform's commands, listed after the applications' groups.
PLATFORM_COMMANDS = [
    "mariana.serving.cli",
    "mariana.platform.jobs.cli",
    "mariana.platform.tune.cli",
    "mariana.platform.cli.runs",
]


def version_text() -> str:
    """``mariana X.Y.Z (torch A.B.C)``, from the installed distributions' metadata (torch not imported)."""

    def v(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return f"mariana {v('mariana')} (torch {v('torch')})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mariana",
        description="Mariana: data-parallel, model-parallel and parameter-server training for speech, "
        "vision and click prediction. Every command writes a run directory and prints its headline metric last.",
    )
    parser.add_argument(
        "--version", action="version", version=version_text(), help="print the versions of mariana and torch"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in [spec.cli for spec in all_apps()] + PLATFORM_COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):  # that app is not part of this build
                continue
            raise
        module.register(sub)
    _fix_help_formatters(parser)
    return parser


def _fix_help_formatters(parser: argparse.ArgumentParser) -> None:
    """Every (sub)parser that shows defaults uses `DefaultsHelpFormatter`, which leaves out
    ``(default: None)`` on required flags and empty defaults."""
    if parser.formatter_class is argparse.ArgumentDefaultsHelpFormatter:
        parser.formatter_class = DefaultsHelpFormatter
    for sub in set(subcommands(parser).values()):
        _fix_help_formatters(sub)


def check_command(argv: list[str], cwd: str | None = None, tasks: int = 1) -> None:
    """Validate a ``mariana`` command line without running it or writing anything (``mariana submit`` and
    ``POST /api/jobs`` before queueing): its flags as the command's own parser reads them (argparse's usage
    + error, exit 2); for a training command its resolved config, its ``--data`` paths (they exist) and its
    ``--out`` (`outputs.guard_output`'s rule); the other output folders' rule (`guard_parsed`). MarianaError:
    the line the command would print. ``cwd``: the job's folder, which relative paths name (default: ours).
    ``tasks`` > 1: checked as each agent of a multi-task Slurm job runs it (--nnodes TASKS, a rendezvous)."""
    args = build_parser().parse_args(argv)
    if cwd is None:
        guard_parsed(args)
    spec = getattr(args, "_config", None)
    if spec and tasks > 1 and "nnodes" in {f.name for f in dataclasses.fields(spec[0])}:
        args.nnodes, args.rdzv_endpoint = tasks, "127.0.0.1:29500"  # loopback: not connected to
    cfg = resolve_config(spec[0], args, spec[1] or {}) if spec else None
    if not hasattr(cfg, "data"):
        return
    if not cfg.data:
        raise MarianaError("--data is required")

    def path(name: str) -> str:  # relative to the job's folder: resolve_config made it absolute to ours
        raw = getattr(args, name, None)
        return os.path.join(cwd, raw) if cwd and isinstance(raw, str) and raw else getattr(cfg, name)

    data = path("data")
    for item in [data] if os.path.exists(data) else data.split(","):  # a comma-separated list of files
        if not os.path.exists(item.strip()):
            raise MarianaError(f"--data {item.strip()}: no such file or directory")
    command = command_of(args)[0]
    if command and getattr(cfg, "out", ""):
        force = bool(getattr(cfg, "force", False)) and not getattr(cfg, "resume", False)
        guard_output(path("out"), "--out", command, "run", force, create=False, config_cls=type(cfg))


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code. In a worker started by our launcher, output goes to the
    rank's log file and a failure is recorded for the launcher's one-line summary (`runtime.workerio`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    worker = WorkerIO.install()
    try:
        try:
            rc = _main(argv, worker)
        except SystemExit:  # --help, argparse errors: flushed here, where a closed pipe is caught
            sys.stdout.flush()
            raise
        sys.stdout.flush()
        return rc
    except BrokenPipeError:  # the reader went away (`... | head -1`): stop quietly, as `cat` and `ls` do
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by a closed pipe


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise BrokenPipeError again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (tests, embedding)
        pass


def _main(argv: list[str], worker) -> int:
    args = build_parser().parse_args(argv)
    outputs = []
    try:
        if worker is None:  # a worker re-runs its launcher's command: the launcher checked its outputs
            outputs = guard_parsed(args)
        try:
            spec = getattr(args, "_config", None)
            if spec is not None:  # before the handler's (torch) imports: a bad flag or value fails at once
                args._resolved = resolve_config(spec[0], args, spec[1] or {})
            rc = args.func(args, argv)
        finally:
            mark_made(outputs)
    except (Exception, KeyboardInterrupt) as e:
        rc = e.exit_code if isinstance(e, MarianaError) else 130 if isinstance(e, KeyboardInterrupt) else 1
        if worker is not None:  # it records the cause and ends: the launcher prints it once for all ranks
            worker.end(e, rc)
        if not isinstance(e, MarianaError | KeyboardInterrupt):
            raise  # a crash: its traceback
        line = f"mariana: error: {e}" if isinstance(e, MarianaError) else "mariana: interrupted"
        print(line, file=sys.stderr)
    sys.stdout.flush()
    return int(rc or 0)


def run() -> None:
    # c10d's C++ warnings (e.g. a store call to a host whose job just ended: a stack dump on a normal end of a
    # multi-node job) stay off the console; TORCH_CPP_LOG_LEVEL=WARNING shows them. Read as torch loads.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    sys.exit(main())


if __name__ == "__main__":  # python -m mariana.platform.cli.main
    run()
