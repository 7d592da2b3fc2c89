"""``mariana mlp train|eval``: the platform's smoke-test job (a small click MLP on libFM data).

The parsers only (standard library + the config sections); the handlers are in `commands.py`, imported
when a command runs."""

from __future__ import annotations

import argparse

from mariana.platform.cli.common import add_train_parser
from mariana.platform.cli.dispatch import handler

from .configs import PRESETS, MlpConfig


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
    e = g.add_parser(
        "eval",
        help="AUC/logloss of an exported run on a libFM file",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    e.add_argument("--model", required=True, help="run directory of a finished `mariana mlp train`")
    e.add_argument("--data", required=True, help="libFM file to score")
    e.add_argument(
        "--split",
        choices=["all", "train", "val", "test"],
        default="all",
        help="rows of --data to score: all, or the train/val/test rows of that file as `mlp train` split "
        "them (by row order: train | val | test, the run's --val-fraction and --test-fraction)",
    )
    e.set_defaults(func=handler("mariana.apps.mlp.commands:evaluate"))
