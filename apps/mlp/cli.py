"""``mariana mlp train|eval``: the platform's smoke-test job (a small click MLP on libFM data).

The parsers only (standard library + the config sections); the handlers are in `commands.py`, imported
when a command runs."""

from __future__ import annotations

from mariana.platform.cli.common import add_command_parser, add_train_parser
from mariana.platform.cli.dispatch import handler

from .configs import PRESETS, MlpConfig, MlpEvalConfig


def register(sub) -> None:
    """Add ``mlp`` with its ``train`` and ``eval`` commands to the ``mariana`` subparsers ``sub``."""
    grp = sub.add_parser("mlp", help="smoke-test job: a small click MLP on libFM data (data-parallel demo)")
    g = grp.add_subparsers(dest="mlp_command", required=True, metavar="COMMAND")
    add_train_parser(
        g,
        "train",
        MlpConfig,
        "train the click MLP with synchronous data-parallel SGD",
        handler("mariana.apps.mlp.commands:train"),
        PRESETS,
    )
    add_command_parser(
        g,
        "eval",
        MlpEvalConfig,
        "AUC/logloss of an exported run on a libFM file",
        handler("mariana.apps.mlp.commands:evaluate"),
    )
