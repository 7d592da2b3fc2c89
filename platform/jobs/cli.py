"""``mariana jobs serve|list|show|logs|cancel|wait|retry`` and ``mariana submit``: the parsers (standard
library only, so ``mariana --help`` stays fast); the handlers (``commands.py``, ``serve.py``) are imported by
the CLI's dispatch when a command runs.
"""

from __future__ import annotations

import argparse
import os

from mariana.platform.cli.dispatch import handler

DEFAULT_PORT = 8765


def _client_flags(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
    p.add_argument("--url", default=None,
                   help=f"the job service (default: env MARIANA_JOBS_URL or http://127.0.0.1:{DEFAULT_PORT})")  # fmt: skip
    p.add_argument(
        "--token-file", default=None, help="file holding the service's token (or env MARIANA_JOBS_TOKEN)"
    )
    if json_flag:
        p.add_argument("--json", action="store_true", help="print JSON instead of text")


def register(sub) -> None:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    s = sub.add_parser(
        "submit",
        help="queue a job on the job service: `mariana submit [--priority P] [--name N] APP CMD [ARGS...]`",
        description="Queue `mariana APP CMD ARGS...` on the job service and print its id (last line). "
        "Submit options go BEFORE the app name; everything from the app name on is the job's argv.",
        formatter_class=fmt,
    )
    s.add_argument("--priority", type=int, default=0, help="higher runs first; FIFO within a priority")
    s.add_argument("--name", default="", help="a label for the job")
    r = s.add_argument_group("resources (the local executor refuses what it cannot honour)")
    r.add_argument(
        "--nodes", type=int, default=None, help="Slurm: nodes, one torchrun agent per task (default 1)"
    )
    r.add_argument("--tasks-per-node", type=int, default=None, help="Slurm: agents per node (default 1)")
    r.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (sbatch --gpus-per-node)")
    r.add_argument("--cpus-per-task", type=int, default=None, help="CPUs per task (sbatch --cpus-per-task)")
    r.add_argument("--time", default=None, help="Slurm: time limit, e.g. 30, 1:30:00, 2-00")
    r.add_argument("--partition", default=None, help="Slurm: partition (default: the service's --partition)")
    _client_flags(s, json_flag=False)
    s.add_argument(
        "job", nargs=argparse.REMAINDER, metavar="APP CMD [ARGS...]", help="the job's command line"
    )
    s.set_defaults(func=handler("mariana.platform.jobs.commands:submit"))

    grp = sub.add_parser("jobs", help="the job service: serve, list, show, logs, cancel, wait, retry")
    g = grp.add_subparsers(dest="jobs_command", required=True, metavar="COMMAND")
    p = g.add_parser("serve", help="run the job service (REST API, web UI, scheduler)", formatter_class=fmt)
    p.add_argument("--home", default=os.environ.get("MARIANA_HOME", "~/.mariana"),
                   help="folder of the database (jobs.db) and of run directories (runs/job-ID); env MARIANA_HOME")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to bind; off-loopback needs --token-file")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port (0: a free one, printed)")
    p.add_argument("--slots", type=int, default=None, help="slot budget (default: the core count)")
    p.add_argument(
        "--db-url", default=None, help="SQLAlchemy URL (default: sqlite:///HOME/jobs.db, WAL mode)"
    )
    p.add_argument("--token-file", default=None, help="file holding the bearer token mutating requests need")
    p.add_argument("--log-level", default="warning", help="uvicorn log level")
    p.add_argument("--executor", choices=("local", "slurm"), default="local",
                   help="where jobs run: process groups on this host, or Slurm batch jobs (sbatch)")  # fmt: skip
    p.add_argument(
        "--partition", default=None, help="--executor slurm: default partition (sbatch --partition)"
    )
    p.add_argument("--account", default=None, help="--executor slurm: account (sbatch --account)")
    p.add_argument("--sbatch-arg", action="append", default=None, metavar="ARG",
                   help="--executor slurm: an extra sbatch argument, e.g. --sbatch-arg=--qos=high (repeatable)")  # fmt: skip
    p.set_defaults(func=handler("mariana.platform.jobs.serve:serve"))

    p = g.add_parser("list", help="all jobs, newest first", formatter_class=fmt)
    _client_flags(p)
    p.set_defaults(func=handler("mariana.platform.jobs.commands:list_jobs"))
    for name, help in (
        ("show", "one job's details"),
        ("cancel", "cancel a queued or running job (SIGTERM to its process group, SIGKILL later)"),
        ("retry", "queue a failed/cancelled job again as a new job, with --resume"),
    ):
        p = g.add_parser(name, help=help, formatter_class=fmt)
        p.add_argument("id", type=int, help="job id")
        _client_flags(p)
        p.set_defaults(func=handler(f"mariana.platform.jobs.commands:{name}"))
    p = g.add_parser("logs", help="a job's log (RUN/job.log)", formatter_class=fmt)
    p.add_argument("id", type=int, help="job id")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    p.add_argument("--tail", type=int, default=200, help="last N lines")
    _client_flags(p)
    p.set_defaults(func=handler("mariana.platform.jobs.commands:logs"))
    p = g.add_parser(
        "wait", help="wait for a job to end; exit 0 if it succeeded, 1 otherwise", formatter_class=fmt
    )
    p.add_argument("id", type=int, help="job id")
    p.add_argument("--timeout", type=float, default=0, help="give up after S seconds (0: never)")
    _client_flags(p)
    p.set_defaults(func=handler("mariana.platform.jobs.commands:wait"))
