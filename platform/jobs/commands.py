"""The handlers of the job service's client commands, ``mariana submit`` and ``mariana jobs
list|show|logs|cancel|retry|wait`` (parsers in ``cli.py``; the CLI's dispatch imports this module when one
of them runs). They talk HTTP only (``client.py``); ``mariana jobs serve`` is ``serve.py``."""

from __future__ import annotations

import json
import os
import sys
import time

from mariana.platform.cli.main import check_command
from mariana.platform.core.errors import MarianaError

from .client import FINAL_STATES, JobsClient, read_token


def _client(args) -> JobsClient:
    """The client of ``--url`` (or env MARIANA_JOBS_URL, or the default address) with ``--token-file``'s token."""
    return JobsClient(args.url, read_token(getattr(args, "token_file", None)))


def _fmt_time(t) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _fmt_best(b) -> str:
    return f"{b['name']} {b['value']:.4f}" if b else "-"


def submit(args, argv) -> int:
    """``mariana submit``: check the job's command line as the command would, queue it, print its id."""
    if not args.job:
        raise MarianaError("nothing to submit: expected `mariana submit [options] APP COMMAND [ARGS...]`")
    # what the command would refuse is refused now, not after queueing
    check_command(args.job, tasks=(args.nodes or 1) * (args.tasks_per_node or 1))
    resources = {k: getattr(args, k) for k in ("nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task",
                                               "time", "partition")}  # fmt: skip
    job = _client(args).submit(args.job, args.priority, args.name, os.getcwd(), resources)
    print(f"submitted job {job['id']}: {' '.join(job['argv'])} ({job['slots']} slot(s), run dir {job['run_dir']})",
          file=sys.stderr)  # fmt: skip
    print(job["id"])
    return 0


def list_jobs(args, argv) -> int:
    """``mariana jobs list``: all jobs, newest first (a table, or --json)."""
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


def show(args, argv) -> int:
    """``mariana jobs show ID``: one job's fields."""
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


def logs(args, argv) -> int:
    """``mariana jobs logs ID [-f]``: the job's log tail (following it until the job ends with -f)."""
    c = _client(args)
    r = c.logs(args.id, tail=args.tail)
    if args.json and not args.follow:
        print(json.dumps(r))
        return 0
    sys.stdout.write(r["text"])
    if not args.follow:
        return 0
    offset = r["next"]
    while True:
        done = c.job(args.id)["state"] in FINAL_STATES
        r = c.logs(args.id, offset=offset)
        sys.stdout.write(r["text"])
        sys.stdout.flush()
        offset = r["next"]
        if done and not r["text"]:
            return 0
        if not r["text"]:
            time.sleep(0.5)


def cancel(args, argv) -> int:
    """``mariana jobs cancel ID``."""
    j = _client(args).cancel(args.id)
    print(json.dumps(j, indent=2) if args.json else f"job {j['id']}: {j['state']}" +
          (" (cancelling)" if j["state"] == "running" else ""))  # fmt: skip
    return 0


def retry(args, argv) -> int:
    """``mariana jobs retry ID``: print the new job's id."""
    j = _client(args).retry(args.id)
    if args.json:
        print(json.dumps(j, indent=2))
    else:
        print(f"job {args.id} retried as job {j['id']}: {' '.join(j['argv'])}", file=sys.stderr)
        print(j["id"])
    return 0


def wait(args, argv) -> int:
    """``mariana jobs wait ID``: 0 when the job succeeded, 1 otherwise or on --timeout."""
    c = _client(args)
    deadline = time.monotonic() + args.timeout if args.timeout else None
    while True:
        j = c.job(args.id)
        if j["state"] in FINAL_STATES:
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
