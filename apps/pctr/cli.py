"""``mariana pctr train|eval|drift-logs|stream``: click-through-rate prediction (single process or parameter servers).

The parsers only (standard library + the config sections, so ``mariana --help`` stays fast); the handlers
are in `commands.py`, imported when a command runs."""

from __future__ import annotations

from mariana.platform.cli.common import add_command_parser, add_train_parser
from mariana.platform.cli.dispatch import handler
from mariana.platform.cli.outputs import mark_output

from .configs import PRESETS, PctrConfig
from .streams.config import STREAM_PRESETS, StreamConfig
from .tool_configs import DriftLogsConfig, PctrEvalConfig

COMMANDS = "mariana.apps.pctr.commands"


def register(sub) -> None:
    """Add ``pctr`` with its commands to the ``mariana`` subparsers ``sub``."""
    grp = sub.add_parser(
        "pctr", help="click-through-rate prediction (LR/FM/DNN/DeepFM/DCN, parameter servers)"
    )
    g = grp.add_subparsers(dest="pctr_command", required=True, metavar="COMMAND")
    t = add_train_parser(
        g,
        "train",
        PctrConfig,
        "train a click model in one process (--servers 0) or with S parameter servers and W async workers",
        handler(f"{COMMANDS}:train"),
        PRESETS,
    )
    mark_output(t, "--image-cache", "continue", "pctr image cache")
    add_command_parser(
        g,
        "eval",
        PctrEvalConfig,
        "AUC/logloss of a trained run on a data file; writes RUN/eval/<data>[-<split>].json",
        handler(f"{COMMANDS}:evaluate"),
    )
    d = add_command_parser(
        g,
        "drift-logs",
        DriftLogsConfig,
        "write days of drifting Criteo-format click logs (ads born and retired, drifting click rates)",
        handler(f"{COMMANDS}:drift_logs"),
        description="Writes DIR/day-01.tsv ... (label, I1-I13, C1-C26; each file written under a temporary "
        "name and renamed) and DIR/_generator.json; deterministic from the settings. Columns and the model "
        "behind them: apps/pctr/README.md, 'Day partitions, incremental training and drifting click logs'.",
    )
    mark_output(d, "--out", "never")
    add_train_parser(
        g,
        "stream",
        StreamConfig,
        "follow a folder of click logs: score each new complete file with the current model (progressive "
        "AUC), train on it once in arrival order, export a new model version every N files or S seconds "
        "(`mariana serve --pctr RUN --watch` picks it up); checkpoint with the consumed-file ledger after "
        "each file (--resume continues); stops on Ctrl-C, --max-files or --idle-exit",
        handler(f"{COMMANDS}:stream"),
        STREAM_PRESETS,
    )
