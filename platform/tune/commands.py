"""The handler of ``mariana tune`` (the parser is ``cli.py``; the CLI's dispatch imports this module when
the command runs)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import httpx
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.evaluator import higher_is_better, metric_name
from mariana.platform.core.tracking import start_study
from mariana.platform.jobs.client import JobsClient, read_token
from mariana.platform.runtime.launch import fork_server

from .apps import app_info
from .cli import DIRECTIONS
from .runners import JobRunner, LocalRunner
from .space import load_space
from .study import TuneOptions, run_study


def _train_options(app_parser: argparse.ArgumentParser | None) -> set[str]:
    """Option strings of ``mariana APP train``, from the app's parser in the CLI's own tree."""
    kind = argparse._SubParsersAction
    subs = [a.choices for a in getattr(app_parser, "_actions", []) if isinstance(a, kind)]
    train = subs[0].get("train") if subs else None
    return set(train._option_string_actions) if train is not None else set()


def _check_train_flags(app: str, app_parser, flags: list[str], space) -> None:
    """`MarianaError` unless every pass-through flag is one of ``mariana APP train``'s, none is the tuner's
    own or searched by the space, and --data is given."""
    known = _train_options(app_parser)
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


def tune(args, argv) -> int:
    """``mariana tune``: check the flags, pick local processes or the job service, run the study -> its
    exit code (0 when a trial completed)."""
    info = app_info(args.app)
    for flag, v, lo in (("--trials", args.trials, 1), ("--parallel", args.parallel, 1)):
        if v < lo:
            raise MarianaError(f"{flag} must be >= {lo}, got {v}")
    if args.timeout < 0:
        raise MarianaError(f"--timeout must be >= 0 seconds (0: no limit), got {args.timeout}")
    space = load_space(args.space, info.config_cls())
    _check_train_flags(args.app, args.app_parsers.get(args.app), args.train_flags, space)
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
    shown = {f"tune.{k}": str(v) for k, v in vars(args).items() if isinstance(v, str | int | float | list)}
    study = start_study(args.app, out, shown)  # the MLflow parent run of the trials
    out.mkdir(parents=True, exist_ok=True)
    app = info.module.rpartition(".")[0]  # local trials fork from a server that imported the CLI and the app
    modules = ("mariana.platform.cli.main", f"{app}.commands", f"{app}.train")
    with fork_server(out / "fork-server.log", modules) if client is None else contextlib.nullcontext():
        rc = run_study(opts, runner)
    study.final({"steps": 0, "exit_code": rc})
    return rc
