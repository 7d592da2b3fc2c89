"""``mariana tune APP --space SPACE.toml --trials N --parallel P --out TUNE_DIR [...] TRAIN_FLAGS...``

Flags the tuner does not know (``--data``, ``--format``, ``--preset``, ...) go to every trial's
``mariana APP train`` command. This module holds the parser (standard library and the app registry only);
the handler is ``commands.tune``, imported by the CLI's dispatch when the command runs.
"""

from __future__ import annotations

import argparse

from mariana.platform.cli.dispatch import handler
from mariana.platform.cli.outputs import mark_output
from mariana.platform.core.registry import tunable_apps

from .apps import tunable

DIRECTIONS = {"max": "maximize", "min": "minimize"}


class _PassThroughParser(argparse.ArgumentParser):
    """Keeps the arguments it does not know, in order, in ``train_flags`` instead of refusing them."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extra = super().parse_known_args(args, namespace)
        ns.train_flags = list(getattr(ns, "train_flags", None) or []) + list(extra)
        return ns, []


def register(sub) -> None:
    """Add ``tune`` to the ``mariana`` subparsers ``sub`` (after the apps' groups: the handler checks the
    pass-through flags against ``sub``'s ``APP train`` parsers)."""
    saved = sub._parser_class
    sub._parser_class = _PassThroughParser
    try:
        p = sub.add_parser(
            "tune",
            help="model selection: search training flags with Optuna (TPE, pruning), export the best model",
            description="Run N trials of `mariana APP train` (P at a time; as jobs of the job service when one "
            "is running, else local processes), prune bad ones from their eval records, and write "
            "TUNE_DIR/best.toml, TUNE_DIR/best/ (the best run) and results.json. Flags not listed here "
            "go to every trial's train command. The same --out again continues the study.",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
            allow_abbrev=False,
        )
    finally:
        sub._parser_class = saved
    p.add_argument("app", choices=sorted(tunable()), help="the application whose `train` is tuned")
    p.add_argument("--space", required=True, help="search space TOML ([params.NAME] tables and [fixed])")
    p.add_argument("--trials", type=int, default=20, help="trials to finish (complete, pruned or failed)")
    p.add_argument("--parallel", type=int, default=1, help="trials in flight at once")
    p.add_argument("--out", required=True, help="study directory (an existing one is continued)")
    defaults = ", ".join(f"{s.name}: {s.tune.monitor}" for s in tunable_apps())
    p.add_argument("--monitor", default="", help=f"metric to optimise (default: the app's own; {defaults})")
    p.add_argument("--direction", choices=sorted(DIRECTIONS), default=None,
                   help="max or min (default: the metric's own, e.g. max for auc, min for logloss and wer)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=0.0,
                   help="seconds after which no new trial starts (running ones finish); 0: none")  # fmt: skip
    p.add_argument("--pruner", choices=["median", "hyperband", "none"], default="median",
                   help="how trials are stopped early from their --eval-every records")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the TPE sampler")
    p.add_argument("--url", default=None, help="job service URL (default: env MARIANA_JOBS_URL or "
                   "http://127.0.0.1:8765, used if one answers)")  # fmt: skip
    p.add_argument("--token-file", default=None, help="bearer token for the job service")
    p.add_argument(
        "--local", action="store_true", help="run trials as local processes even if a service runs"
    )
    p.set_defaults(
        func=handler("mariana.platform.tune.commands:tune"), train_flags=[], app_parsers=sub.choices
    )
    mark_output(p, "--out", "continue")
