"""The ``mariana`` command: one entry point with a subcommand group per application.

Each command module provides ``register(subparsers)``; leaf parsers set ``func(args, argv) -> int``.
Modules import only the standard library at import time, so ``mariana --help`` is fast.
A `MarianaError` (bad flag value, bad config file, missing data) prints one line and exits with 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..core.errors import MarianaError

COMMAND_MODULES = [
    "mariana.platform.mlpjob.cli",
    "mariana.apps.asr.cli",
    "mariana.apps.vision.cli",
    "mariana.apps.pctr.cli",
    "mariana.serving.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mariana",
        description="Mariana: data-parallel, model-parallel and parameter-server training for speech, "
        "vision and click prediction. Every command writes a run directory and prints its headline metric last.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):  # that app is not part of this build
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args, argv)
    except MarianaError as e:
        print(f"mariana: error: {e}", file=sys.stderr)
        rc = e.exit_code
    except KeyboardInterrupt:
        print("mariana: interrupted", file=sys.stderr)
        rc = 130
    sys.stdout.flush()
    return int(rc or 0)


def run() -> None:
    sys.exit(main())
