"""``mariana tune APP --space SPACE.toml --trials N --parallel P --out TUNE_DIR [...] TRAIN_FLAGS...``

Flags the tuner does not know (``--data``, ``--format``, ``--preset``, ...) go to every trial's
``mariana APP train`` command. Only the standard library is imported at module level.
"""

from __future__ import annotations

import argparse
import os
import sys

DIRECTIONS = {"max": "maximize", "min": "minimize"}


class _PassThroughParser(argparse.ArgumentParser):
    """Keeps the arguments it does not know, in order, in ``train_flags`` instead of refusing them."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extra = super().parse_known_args(args, namespace)
        ns.train_flags = list(getattr(ns, "train_flags", None) or []) + list(extra)
        return ns, []


def _train_options(app: str) -> set[str]:
    """Option strings of ``mariana APP train`` (from the CLI's own parser)."""
    from mariana.platform.cli.main import build_parser

    def subs(p):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                return a.choices
        return {}

    app_parser = subs(build_parser()).get(app)
    train = subs(app_parser).get("train") if app_parser is not None else None
    return set(train._option_string_actions) if train is not None else set()


def _check_train_flags(app: str, flags: list[str], space) -> None:
    from mariana.platform.core.errors import MarianaError

    known = _train_options(app)
    searched = {"--" + n.replace("_", "-") for n in [*space.params, *space.fixed]}
    for a in flags:
        if not a.startswith("--"):
            continue
        flag = a.split("=", 1)[0]
        if flag not in known:
            raise MarianaError(
                f"unknown flag {flag}: neither a `mariana tune` flag nor one of `mariana {app} train`"
            )
        if flag in ("--out", "--resume", "--config"):
            raise MarianaError(f"{flag}: the tuner sets it for every trial; remove it")
        if flag in searched or flag.replace("--no-", "--", 1) in searched:
            raise MarianaError(
                f"{flag} is given on the command line and in the space file {space.path}: keep one"
            )
    if not any(a == "--data" or a.startswith("--data=") for a in flags):
        raise MarianaError(f"give --data PATH: the data every trial of `mariana {app} train` trains on")


def _service(args):
    """A JobsClient when a job service answers (at --url, env MARIANA_JOBS_URL or the default address),
    else None. An explicit --url that does not answer is an error."""
    import httpx
    from mariana.platform.core.errors import MarianaError
    from mariana.platform.jobs.client import JobsClient, read_token

    if args.local:
        return None
    client = JobsClient(args.url, read_token(args.token_file))
    try:
        client.http.get("/healthz", timeout=2.0).raise_for_status()
    except (httpx.TransportError, httpx.HTTPStatusError):
        if args.url:
            raise MarianaError(f"--url {args.url}: no job service answers there (or use --local)") from None
        return None
    return client


def _tune(args, argv) -> int:
    from pathlib import Path

    from mariana.platform.core.errors import MarianaError
    from mariana.platform.core.evaluator import higher_is_better, metric_name

    from .apps import app_info
    from .runners import JobRunner, LocalRunner
    from .space import load_space
    from .study import TuneOptions, run_study

    info = app_info(args.app)
    for flag, v, lo in (("--trials", args.trials, 1), ("--parallel", args.parallel, 1)):
        if v < lo:
            raise MarianaError(f"{flag} must be >= {lo}, got {v}")
    if args.timeout < 0:
        raise MarianaError(f"--timeout must be >= 0 seconds (0: no limit), got {args.timeout}")
    space = load_space(args.space, info.config_cls())
    _check_train_flags(args.app, args.train_flags, space)
    monitor = metric_name(args.monitor or info.monitor)
    if args.direction:
        direction = DIRECTIONS[args.direction]
    else:  # the Trainer's own table of metric directions (auc up, logloss/wer down, ...)
        direction = "maximize" if higher_is_better(monitor) else "minimize"
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise MarianaError(f"--out {args.out}: exists and is not a directory")
    client = _service(args)
    parallel = args.parallel
    if client is None:
        cores = os.cpu_count() or 1
        if parallel > cores:
            print(f"mariana: warning: --parallel {parallel} capped at {cores} (the cores of this machine)",
                  file=sys.stderr)  # fmt: skip
            parallel = cores
        runner = LocalRunner(threads=max(1, cores // parallel))
    else:
        runner = JobRunner(client, out.resolve().name)
    opts = TuneOptions(
        app=args.app, info=info, space=space, trials=args.trials, parallel=parallel, out=out,
        monitor=monitor, direction=direction, timeout=args.timeout, pruner=args.pruner, seed=args.seed,
        train_flags=list(args.train_flags), url=client.url if client else None, client=client,
    )  # fmt: skip
    return run_study(opts, runner)


def register(sub) -> None:
    from mariana.platform.cli.outputs import mark_output
    from mariana.platform.core.registry import tunable_apps

    from .apps import tunable

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
    p.set_defaults(func=_tune, train_flags=[])
    mark_output(p, "--out", "continue")
