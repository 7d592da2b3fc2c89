"""The platform's one launcher: N local processes through torchrun's agent (torch.distributed.run).

Every multi-process job starts here: the data-parallel jobs (`launch_if_needed`, called by
``mariana <app> train --workers N``) and the parameter-server jobs (`mariana.platform.ps.master.run_job`,
S servers + W workers). `launch` runs torchrun's agent in this process with c10d rendezvous on a free
loopback port (``--standalone``) or on a given ``HOST:PORT`` for several nodes, ``max_restarts`` restarts of
the whole group, per-rank logs (``RUN/logs/rank-R.log``, `workerio`; the agent's in ``launcher.log``) and
one console line per failed process (the console, failure and Ctrl-C behaviour: ``platform/README.md``,
"Data parallel"); exit code 2 when every failed process reported bad input, else 1. Inside a process the
launcher started, `in_worker` is true and the command trains instead of launching.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from ..core.endpoint import is_this_host, split_endpoint, wait_s
from .workerio import CONSOLE_RANK_ENV, CONSOLE_TTY_ENV, RUN_DIR_ENV, failure_lines

CLI_MODULE = "mariana.platform.cli"


def in_worker() -> bool:
    """True inside a process started by torchrun (or any launcher that sets RANK/WORLD_SIZE)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def needs_launcher(cfg) -> bool:
    """A data-parallel job runs under the launcher with several workers or nodes, or to be restarted."""
    return cfg.workers > 1 or cfg.nnodes > 1 or cfg.max_restarts > 0


def torchrun_args(
    nproc_per_node: int,
    argv: list[str],
    *,
    nnodes: int = 1,
    max_restarts: int = 0,
    rdzv_endpoint: str = "",
    rdzv_id: str = "",
    module: str = CLI_MODULE,
) -> list[str]:
    """torchrun's command line: ``nproc_per_node`` processes running ``python -m module argv``."""
    args = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node)]
    args += ["--max-restarts", str(max_restarts), "--monitor-interval", "0.5"]
    if nnodes == 1 and not rdzv_endpoint:
        args += ["--standalone"]  # c10d on a free loopback port, a fresh rendezvous id
    else:
        args += [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            rdzv_endpoint,
            "--rdzv-id",
            rdzv_id or "mariana",
            "--rdzv-conf",
            _rdzv_conf(rdzv_endpoint),
        ]
    return [*args, "-m", module, *argv]


def _rdzv_conf(endpoint: str) -> str:
    """torchrun's ``--rdzv-conf``: a node that has not joined within the wait ends the rendezvous; and
    this node hosts the store when the endpoint is one of its interfaces' addresses that torch's guess
    (the hostname's addresses) misses. Where torch guesses right it keeps its fallback: a second agent on
    the same node, finding the port taken, joins as a client (Slurm's --tasks-per-node above 1)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    host = split_endpoint(endpoint)[0]
    second_interface = is_this_host(host) and not _matches_machine_hostname(host)
    return f"join_timeout={max(1, int(wait_s()))}" + (",is_host=True" if second_interface else "")


def stall_reports(run_dir: str | Path) -> list[dict]:
    logs = Path(run_dir) / "logs"
    out = []
    for p in sorted(logs.glob("stall-rank-*.json")) if logs.is_dir() else []:
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            pass
    return out


def worker_threads(nproc_per_node: int) -> int:
    """CPU threads per worker when ``nproc_per_node`` processes share this machine (at least 1):
    more would oversubscribe the cores."""
    return max(1, (os.cpu_count() or 1) // max(1, nproc_per_node))


def _quiet_launcher_logs(run_dir: Path) -> None:
    """torchrun's agent logs (restarts, failures, signals) go to ``RUN/logs/launcher.log``, not the
    console: the launcher prints its own one-line summary."""
    import logging

    path = str(run_dir / "logs" / "launcher.log")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        lg = logging.getLogger(name)
        lg.propagate = False
        for old in [h for h in lg.handlers if getattr(h, "baseFilename", None) == path]:
            lg.removeHandler(old)  # a second launch in this process: one handler per file
            old.close()
        lg.addHandler(handler)


def _stop_on_lost_host(run_dir: Path, lost: dict, done: threading.Event) -> None:
    """Until ``done``: once a rank of this host reports a lost host (`watchdog.exit_lost`), put its message in
    ``lost`` and SIGTERM this process: torchrun's agent stops its workers, no restart (README, "A lost host /
    link down"); if the agent is stuck in a store call to the lost host, kill the workers and exit 1 here."""
    me = (socket.gethostname(), os.getpid())
    while not done.wait(0.25):
        for r in stall_reports(run_dir):
            if r.get("lost") and (r.get("host"), r.get("agent")) == me:
                lost["message"] = r["message"]
                os.kill(os.getpid(), signal.SIGTERM)
                if done.wait(5):
                    return
                for stat in Path("/proc").glob("[0-9]*/stat"):  # this agent's workers
                    with contextlib.suppress(OSError, IndexError):
                        if stat.read_text().rsplit(")", 1)[1].split()[1] == str(os.getpid()):
                            os.kill(int(stat.parent.name), signal.SIGKILL)
                print(f"mariana: error: {r['message']} (see {run_dir}/logs/)", file=sys.stderr, flush=True)
                os._exit(1)


def run_torchrun(args: list[str], run_dir: str | Path, nproc_per_node: int, console_rank: int = 0):
    """Run torchrun's agent in this process with ``args`` (its command line); returns None on success,
    the ``ChildFailedError`` of a failed job, or the message of a lost host. Ctrl-C (or SIGTERM) stops
    the workers and raises KeyboardInterrupt.

    Workers get ``OMP_NUM_THREADS`` (unless set) and the run directory, so their output goes to
    ``RUN/logs/rank-R.log`` (see `workerio`); ``console_rank`` keeps its progress bar on the terminal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    run_dir = Path(run_dir).absolute()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for stale in (run_dir / "logs").glob("error-rank-*.json"):  # of an earlier attempt of this run
        stale.unlink(missing_ok=True)
    if not os.environ.get("OMP_NUM_THREADS"):  # else torchrun sets 1 and prints a banner about it
        os.environ["OMP_NUM_THREADS"] = str(worker_threads(nproc_per_node))
    os.environ[RUN_DIR_ENV] = str(run_dir)
    os.environ[CONSOLE_RANK_ENV] = str(console_rank)
    # the workers' stderr is a pipe to this agent: they draw a progress bar only when this one is a terminal
    os.environ[CONSOLE_TTY_ENV] = "1" if sys.stderr.isatty() else "0"
    _quiet_launcher_logs(run_dir)
    lost, done = {}, threading.Event()
    threading.Thread(target=_stop_on_lost_host, args=(run_dir, lost, done), daemon=True).start()
    try:
        run(parse_args(args))
    except SignalException:
        if lost:
            return lost["message"]
        raise KeyboardInterrupt from None
    except ChildFailedError as e:
        return e
    finally:
        done.set()
    return None


def report_failure(
    e, run_dir: str | Path, max_restarts: int = 0, name: Callable[[int], str] | None = None
) -> int:
    """Print one console line per cause of a failed job (``e``: torchrun's ChildFailedError; ``name``:
    rank -> how to name that process, default ``worker rank R``); returns the exit code: 2 when every
    failed process reported bad input, else 1."""
    codes = {int(r): f.exitcode for r, f in e.failures.items()}
    # A watchdog's report (a stall, a lost host) replaces its rank's exit code; reports of other nodes' ranks
    # (a shared run directory) are theirs to print.
    why = {
        rep["rank"]: rep.get("message", "watchdog") for rep in stall_reports(run_dir) if rep["rank"] in codes
    }
    lines, all_user = failure_lines(run_dir, {r: c for r, c in codes.items() if r not in why}, name)
    lines += [f"{m} (see {run_dir}/logs/)" for m in why.values()]
    for line in lines:
        print(f"mariana: error: {line}", file=sys.stderr)
    if max_restarts > 0 and not all_user:
        print(f"mariana: error: the job still failed after {max_restarts} restart(s)", file=sys.stderr)
    return 2 if all_user else 1


def launch(
    nproc_per_node: int,
    argv: list[str],
    run_dir: str | Path,
    *,
    what: str = "",
    nnodes: int = 1,
    max_restarts: int = 0,
    rdzv_endpoint: str = "",
    rdzv_id: str = "",
    console_rank: int = 0,
    name: Callable[[int], str] | None = None,
    module: str = CLI_MODULE,
) -> int:
    """Run ``python -m module argv`` in ``nproc_per_node`` processes on this node (x ``nnodes``) under
    torchrun and return the job's exit code (0, or `report_failure`'s after printing the cause).
    ``what``: the processes, for the one line announcing the launch; ``name``: see `report_failure`."""
    what = what or f"{nproc_per_node} worker(s) x {nnodes} node(s)"
    print(
        f"mariana: launching {what} through torchrun (max restarts {max_restarts}); logs in {run_dir}/logs/",
        file=sys.stderr,
        flush=True,
    )
    args = torchrun_args(
        nproc_per_node,
        argv,
        nnodes=nnodes,
        max_restarts=max_restarts,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        module=module,
    )
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError

    try:
        failure = run_torchrun(args, run_dir, nproc_per_node, console_rank)
    except RendezvousError as e:  # a node that never came, or the first node gone before the group formed
        timed_out = isinstance(e, RendezvousTimeoutError)
        why = f"not all {nnodes} nodes joined within {wait_s():g} s" if timed_out else (str(e) or repr(e))
        print(f"mariana: error: the rendezvous at {rdzv_endpoint} failed: {why} (see {run_dir}/logs/launcher.log)",
              file=sys.stderr)  # fmt: skip
        return 1
    if isinstance(failure, str):  # a lost host: no restart
        print(f"mariana: error: {failure} (see {run_dir}/logs/)", file=sys.stderr)
        return 1
    return 0 if failure is None else report_failure(failure, run_dir, max_restarts, name)


def launch_if_needed(cfg, argv: list[str], module: str = CLI_MODULE) -> int | None:
    """A data-parallel job (``cfg``: a `TrainConfig`). In the user's process: run ``argv`` under the
    launcher and return the job's exit code. In a worker (or when one plain process suffices): return
    None, the caller trains in-process."""
    if in_worker() or not needs_launcher(cfg):
        return None
    return launch(
        cfg.workers,
        argv,
        cfg.out,
        nnodes=cfg.nnodes,
        max_restarts=cfg.max_restarts,
        rdzv_endpoint=cfg.rdzv_endpoint,
        rdzv_id=cfg.rdzv_id,
        module=module,
    )
