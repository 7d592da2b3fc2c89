"""``mariana jobs serve|list|show|logs|cancel|wait|retry`` and ``mariana submit`` (stdlib-only imports at
module level, so ``mariana --help`` stays fast).

Clients find the service through ``--url``, env MARIANA_JOBS_URL, or http://127.0.0.1:8765; mutating
requests send the token from ``--token-file`` or env MARIANA_JOBS_TOKEN.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_PORT = 8765
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
FINAL = ("succeeded", "failed", "cancelled")


def _client(args):
    from .client import JobsClient, read_token

    return JobsClient(args.url, read_token(getattr(args, "token_file", None)))


def _fmt_time(t) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _fmt_best(b) -> str:
    return f"{b['name']} {b['value']:.4f}" if b else "-"


def _serve(args, argv) -> int:
    import socket

    from mariana.platform.core.errors import MarianaError

    from .client import read_token

    token = read_token(args.token_file) if args.token_file else None
    if args.host not in LOOPBACK_HOSTS and not token:
        raise MarianaError(
            f"--host {args.host} is reachable from other machines: give --token-file FILE (a secret that "
            "every mutating request must present), or bind 127.0.0.1"
        )
    if args.slots is not None and args.slots < 1:
        raise MarianaError(f"--slots {args.slots}: expected >= 1")
    if not 0 <= args.port <= 65535:
        raise MarianaError(f"--port {args.port}: expected 0..65535")
    home = os.path.expanduser(args.home)
    try:
        os.makedirs(home, exist_ok=True)
    except OSError as e:
        raise MarianaError(f"--home {args.home}: {e.strerror}") from None
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        raise MarianaError(f"--host {args.host} --port {args.port}: cannot bind ({e.strerror})") from None
    sock.listen(128)
    port = sock.getsockname()[1]

    import uvicorn
    from sqlalchemy.exc import ArgumentError, OperationalError

    from .service import create_app

    executor = None
    if args.executor == "slurm":
        from .slurm import executor_from_args

        executor = executor_from_args(args)
    elif args.partition or args.account or args.sbatch_arg:
        raise MarianaError("--partition/--account/--sbatch-arg need --executor slurm")
    try:
        app = create_app(home, args.db_url, args.slots, token, executor=executor)
    except (ArgumentError, OperationalError) as e:
        raise MarianaError(f"--db-url {args.db_url}: {str(e).splitlines()[0]}") from None
    except ModuleNotFoundError as e:
        raise MarianaError(
            f"--db-url {args.db_url}: the database driver {e.name!r} is not installed"
        ) from None
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"mariana jobs service on http://{host}:{port} (home {home}, {app.state.scheduler.slots} slots, "
          f"{args.executor} executor, docs at /docs)", flush=True)  # fmt: skip
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _submit(args, argv) -> int:
    from mariana.platform.core.errors import MarianaError

    if not args.job:
        raise MarianaError("nothing to submit: expected `mariana submit [options] APP COMMAND [ARGS...]`")
    from mariana.platform.cli.main import check_command

    check_command(args.job)  # what the command would refuse is refused now, not after queueing
    resources = {k: getattr(args, k) for k in ("nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task",
                                               "time", "partition")}  # fmt: skip
    job = _client(args).submit(args.job, args.priority, args.name, os.getcwd(), resources)
    print(f"submitted job {job['id']}: {' '.join(job['argv'])} ({job['slots']} slot(s), run dir {job['run_dir']})",
          file=sys.stderr)  # fmt: skip
    print(job["id"])
    return 0


def _list(args, argv) -> int:
    jobs = _client(args).jobs()
    if args.json:
        print(json.dumps({"jobs": jobs}, indent=2))
        return 0
    rows = [["ID", "STATE", "APP", "CMD", "NAME", "STARTED", "DURATION", "STEP", "BEST"]]
    for j in jobs:
        dur = f"{j['duration_s']:.0f}s" if j["duration_s"] is not None else "-"
        step = "-" if j["last_step"] is None else str(j["last_step"])
        rows.append([str(j["id"]), j["state"], j["app"], j["command"], j["name"] or "-", _fmt_time(j["started"]),
                     dur, step, _fmt_best(j["best_metric"])])  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def _show(args, argv) -> int:
    j = _client(args).job(args.id)
    if args.json:
        print(json.dumps(j, indent=2))
        return 0
    for key in ("id", "name", "state", "app", "command", "priority", "slots", "resources", "executor",
                "run_dir", "pid", "external_id", "exit_code", "last_step", "export", "error", "retry_of"):  # fmt: skip
        print(f"{key:12} {j.get(key) if j.get(key) is not None else '-'}")
    print(f"{'argv':12} {' '.join(j['argv'])}")
    for key in ("created", "started", "ended"):
        print(f"{key:12} {_fmt_time(j[key])}")
    print(f"{'duration_s':12} {j['duration_s'] if j['duration_s'] is not None else '-'}")
    print(
        f"{'best_metric':12} {_fmt_best(j['best_metric'])}"
        + (f" at step {j['best_metric']['step']}" if j["best_metric"] else "")
    )
    if j.get("final_metrics"):
        print(f"{'final':12} {json.dumps(j['final_metrics'], sort_keys=True)}")
    return 0


def _logs(args, argv) -> int:
    c = _client(args)
    if not args.follow:
        r = c.logs(args.id, tail=args.tail)
        if args.json:
            print(json.dumps(r))
        else:
            sys.stdout.write(r["text"])
        return 0
    offset = None
    r = c.logs(args.id, tail=args.tail)
    sys.stdout.write(r["text"])
    offset = r["next"]
    while True:
        done = c.job(args.id)["state"] in FINAL
        r = c.logs(args.id, offset=offset)
        sys.stdout.write(r["text"])
        sys.stdout.flush()
        offset = r["next"]
        if done and not r["text"]:
            return 0
        if not r["text"]:
            time.sleep(0.5)


def _cancel(args, argv) -> int:
    j = _client(args).cancel(args.id)
    print(json.dumps(j, indent=2) if args.json else f"job {j['id']}: {j['state']}" +
          (" (cancelling)" if j["state"] == "running" else ""))  # fmt: skip
    return 0


def _retry(args, argv) -> int:
    j = _client(args).retry(args.id)
    if args.json:
        print(json.dumps(j, indent=2))
    else:
        print(f"job {args.id} retried as job {j['id']}: {' '.join(j['argv'])}", file=sys.stderr)
        print(j["id"])
    return 0


def _wait(args, argv) -> int:
    c = _client(args)
    deadline = time.monotonic() + args.timeout if args.timeout else None
    while True:
        j = c.job(args.id)
        if j["state"] in FINAL:
            break
        if deadline is not None and time.monotonic() > deadline:
            print(f"mariana: job {args.id} is still {j['state']} after {args.timeout:g} s", file=sys.stderr)
            return 1
        time.sleep(0.5)
    if args.json:
        print(json.dumps(j, indent=2))
    else:
        extra = f": {j['error']}" if j.get("error") and j["state"] != "succeeded" else ""
        best = f", best {_fmt_best(j['best_metric'])}" if j.get("best_metric") else ""
        print(f"job {j['id']} {j['state']}{best}{extra}")
    return 0 if j["state"] == "succeeded" else 1


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
    s.set_defaults(func=_submit)

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
    p.set_defaults(func=_serve)

    p = g.add_parser("list", help="all jobs, newest first", formatter_class=fmt)
    _client_flags(p)
    p.set_defaults(func=_list)
    for name, func, help in (
        ("show", _show, "one job's details"),
        ("cancel", _cancel, "cancel a queued or running job (SIGTERM to its process group, SIGKILL later)"),
        ("retry", _retry, "queue a failed/cancelled job again as a new job, with --resume"),
    ):
        p = g.add_parser(name, help=help, formatter_class=fmt)
        p.add_argument("id", type=int, help="job id")
        _client_flags(p)
        p.set_defaults(func=func)
    p = g.add_parser("logs", help="a job's log (RUN/job.log)", formatter_class=fmt)
    p.add_argument("id", type=int, help="job id")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    p.add_argument("--tail", type=int, default=200, help="last N lines")
    _client_flags(p)
    p.set_defaults(func=_logs)
    p = g.add_parser(
        "wait", help="wait for a job to end; exit 0 if it succeeded, 1 otherwise", formatter_class=fmt
    )
    p.add_argument("id", type=int, help="job id")
    p.add_argument("--timeout", type=float, default=0, help="give up after S seconds (0: never)")
    _client_flags(p)
    p.set_defaults(func=_wait)
