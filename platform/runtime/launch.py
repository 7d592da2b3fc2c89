"""The platform's one launcher: N local processes through torchrun's agent (torch.distributed.run).

Every multi-process job starts here: the data-parallel jobs (`launch_if_needed`, called by
``mariana <app> train --workers N``) and the parameter-server jobs (`mariana.platform.ps.master.run_job`,
S servers + W workers). `launch` runs torchrun's agent in this process with c10d rendezvous on a free
loopback port or on a given ``HOST:PORT`` for several nodes, workers forked from a server that imported
torch once (`_run_forked`), restarts of the whole group, per-rank logs (``RUN/logs/rank-R.log``,
`workerio`; the agent's in ``launcher.log``) and one console line per failed process (the console, failure
and Ctrl-C behaviour: ``platform/README.md``, "Data parallel"); exit code 2 when every failed process
reported bad input, else 1. Inside a process the launcher started, `in_worker` is true and the command
trains instead of launching.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from ..core.endpoint import is_this_host, split_endpoint, wait_s
from .workerio import AGENT_ENV, CONSOLE_RANK_ENV, CONSOLE_TTY_ENV, RUN_DIR_ENV, failure_lines

CLI_MODULE = "mariana.platform.cli"


def in_worker() -> bool:
    """True inside a process started by torchrun (or any launcher that sets RANK/WORLD_SIZE)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def needs_launcher(cfg) -> bool:
    """A data-parallel job runs under the launcher with several workers or nodes, or to be restarted."""
    return cfg.workers > 1 or cfg.nnodes > 1 or cfg.max_restarts > 0


def launch_config(nproc: int, at):
    """torchrun's settings for ``nproc`` workers on this node. ``at``: the launch section (a job's
    ``max_restarts``, and ``nnodes``, ``rdzv_endpoint``, ``rdzv_id`` where it may span nodes). A c10d
    rendezvous on a free loopback port with a fresh id (one node, no endpoint) or at the endpoint
    (`_rdzv_conf`); the agent checks its workers every 0.5 s and restarts the whole group on a failure."""
    from torch.distributed.launcher.api import LaunchConfig

    nnodes, endpoint = getattr(at, "nnodes", 1), getattr(at, "rdzv_endpoint", "")
    alone = nnodes == 1 and not endpoint
    endpoint, run_id = ("localhost:0", str(uuid.uuid4())) if alone else (endpoint, at.rdzv_id or "mariana")
    return LaunchConfig(nnodes, nnodes, nproc, run_id=run_id, role="default", rdzv_endpoint=endpoint,
                        rdzv_backend="c10d", rdzv_configs={} if alone else _rdzv_conf(endpoint),
                        max_restarts=at.max_restarts, monitor_interval=0.5, start_method="forkserver")  # fmt: skip


def _rdzv_conf(endpoint: str) -> dict:
    """The rendezvous' settings: a node that has not joined within the wait ends the rendezvous; and
    this node hosts the store when the endpoint is one of its interfaces' addresses that torch's guess
    (the hostname's addresses) misses. Where torch guesses right it keeps its fallback: a second agent on
    the same node, finding the port taken, joins as a client (Slurm's --tasks-per-node above 1)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    host = split_endpoint(endpoint)[0]
    second_interface = is_this_host(host) and not _matches_machine_hostname(host)
    return {"join_timeout": max(1, int(wait_s()))} | ({"is_host": True} if second_interface else {})


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
    agent = "torch.distributed.elastic torch.distributed.run torch.distributed.launcher torch.multiprocessing"
    for name in agent.split():
        lg = logging.getLogger(name)
        lg.propagate = False
        for old in [h for h in lg.handlers if getattr(h, "baseFilename", None) == path]:
            lg.removeHandler(old)  # a second launch in this process: one handler per file
            old.close()
        lg.addHandler(handler)


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, ppid, starttime)`` of a process from /proc/PID/stat, or None if there is none."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after the last ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    return rest[0], int(rest[1]), int(rest[19])


def process_alive(pid: int, start: int | None) -> bool:
    """True if ``pid`` runs (not a zombie) and is the process that started at ``start`` (clock ticks)."""
    st = proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return start is None or st[2] == start


def descendants(pid: int) -> list[tuple[int, int]]:
    """All live descendants of ``pid`` as (pid, starttime), found through the /proc parent links."""
    children: dict[int, list[tuple[int, int]]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = proc_stat(int(d))
            if st is not None and st[0] not in ("Z", "X"):
                children.setdefault(st[1], []).append((int(d), st[2]))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


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
                for pid, _ in descendants(os.getpid()):  # this agent's workers (and their fork server)
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                print(f"mariana: error: {r['message']} (see {run_dir}/logs/)", file=sys.stderr, flush=True)
                os._exit(1)


def run_torchrun(config, argv: list[str], run_dir: str | Path, console_rank: int = 0):
    """Run torchrun's agent (``config``: `launch_config`) in this process, its workers running ``mariana
    argv``; returns None on success,
    the ``ChildFailedError`` of a failed job, or the message of a lost host. Ctrl-C (or SIGTERM) stops
    the workers and raises KeyboardInterrupt.

    Workers get ``OMP_NUM_THREADS`` (unless set) and the run directory, so their output goes to
    ``RUN/logs/rank-R.log`` (see `workerio`); ``console_rank`` keeps its progress bar on the terminal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    run_dir = Path(run_dir).absolute()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if not os.environ.get("OMP_NUM_THREADS"):  # else torchrun sets 1 and prints a banner about it
        os.environ["OMP_NUM_THREADS"] = str(worker_threads(config.nproc_per_node))
    os.environ[RUN_DIR_ENV] = str(run_dir)
    os.environ[AGENT_ENV] = str(os.getpid())
    os.environ[CONSOLE_RANK_ENV] = str(console_rank)
    # the workers' stderr is a pipe to this agent: they draw a progress bar only when this one is a terminal
    os.environ[CONSOLE_TTY_ENV] = "1" if sys.stderr.isatty() else "0"
    _quiet_launcher_logs(run_dir)
    lost, done = {}, threading.Event()
    threading.Thread(target=_stop_on_lost_host, args=(run_dir, lost, done), daemon=True).start()
    try:
        _run_forked(config, argv, run_dir / "logs" / "launcher.log")
    except SignalException:
        if lost:
            return lost["message"]
        raise KeyboardInterrupt from None
    except ChildFailedError as e:
        e.with_traceback(None)
        gc.collect()  # the agent's queues, held by the error's frames: freed now, not reported leaked at exit
        return e
    finally:
        done.set()
    return None


def _run_forked(config, argv: list[str], log: Path) -> None:
    """The agent, with the workers forked from a server that imported torch (with torch._dynamo, which torch's
    optimizers import) and this command's modules once, where ``python -m mariana.platform.cli argv`` would
    import them in each worker (seconds of CPU apiece). The server is this launch's (started with its
    environment, stopped at its end), runs no torch op: the workers start clean (OpenMP's pool dies in a fork)."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    from torch.distributed.launcher.api import elastic_launch

    loaded = [m for m in sys.modules if m.startswith("mariana.") and not m.endswith("__main__")]
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", *sorted(loaded)])
    # multiprocessing's resource tracker: its warnings (the semaphores of killed workers) go to the log
    with open(log, "a") as f:
        console = os.dup(2)
        os.dup2(f.fileno(), 2)
        multiprocessing.resource_tracker.ensure_running()
        os.dup2(console, 2)
        os.close(console)
    try:
        elastic_launch(config=config, entrypoint=_forked_worker)(argv)
    finally:
        multiprocessing.forkserver._forkserver._stop()  # the next launch's server takes its environment


def _forked_worker(argv: list) -> None:
    """One worker, a child of the fork server: ``python -u -m mariana.platform.cli argv`` in a session of
    its own (as torchrun's workers: Ctrl-C reaches the agent, which stops them)."""
    import ctypes
    import runpy

    # PR_SET_PDEATHSIG 0, as torchrun's workers: the fork server's end (a signal to the group) is not ours
    ctypes.CDLL(None).prctl(1, 0)
    os.setsid()
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    sys.argv = [CLI_MODULE, *argv]
    runpy.run_module(CLI_MODULE, run_name="__main__", alter_sys=True)


def _first_failure(run_dir: str | Path, failures: dict, nproc: int) -> dict[int, int]:
    """Global rank -> exit code of the failed worker to name. torchrun's agent reports the first worker whose
    exit it saw, which may have failed because another did (gloo's "connection closed"): when that worker
    left a record (an error or a watchdog report), name the worker of this node whose record came first."""
    rank, f = next(iter(failures.items()))
    logs, base = Path(run_dir) / "logs", int(rank) - f.local_rank
    made = {r: p.stat().st_mtime for r in range(base, base + nproc) for p in logs.glob(f"*-rank-{r}.json")}
    first = min(made, key=made.get) if int(rank) in made else int(rank)
    return {first: f.exitcode if first == int(rank) else 1}


def report_failure(
    e,
    run_dir: str | Path,
    max_restarts: int = 0,
    name: Callable[[int], str] | None = None,
    nproc_per_node: int = 1,
) -> int:
    """Print one console line per cause of a failed job (``e``: torchrun's ChildFailedError; ``name``:
    rank -> how to name that process, default ``worker rank R``); returns the exit code: 2 when every
    failed process reported bad input, else 1."""
    codes = _first_failure(run_dir, e.failures, nproc_per_node)
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
    at,
    *,
    what: str = "",
    console_rank: int = 0,
    name: Callable[[int], str] | None = None,
) -> int:
    """Run ``mariana argv`` in ``nproc_per_node`` processes on this node (of the nodes of ``at``, see
    `launch_config`) under torchrun and return the job's exit code (0, or `report_failure`'s after printing
    the cause). ``what``: the processes, for the launch's line; ``name``: see `report_failure`."""
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError

    config = launch_config(nproc_per_node, at)
    nnodes, restarts = config.max_nodes, config.max_restarts
    what = what or f"{nproc_per_node} worker(s) x {nnodes} node(s)"
    print(f"mariana: launching {what} through torchrun (max restarts {restarts}); logs in {run_dir}/logs/",
          file=sys.stderr, flush=True)  # fmt: skip
    try:
        failure = run_torchrun(config, argv, run_dir, console_rank)
    except RendezvousError as e:  # a node that never came, or the first node gone before the group formed
        timed_out = isinstance(e, RendezvousTimeoutError)
        why = f"not all {nnodes} nodes joined within {wait_s():g} s" if timed_out else (str(e) or repr(e))
        print(f"mariana: error: the rendezvous at {at.rdzv_endpoint} failed: {why} (see {run_dir}/logs/launcher.log)",
              file=sys.stderr)  # fmt: skip
        return 1
    if isinstance(failure, str):  # a lost host: no restart
        print(f"mariana: error: {failure} (see {run_dir}/logs/)", file=sys.stderr)
        return 1
    return 0 if failure is None else report_failure(failure, run_dir, restarts, name, nproc_per_node)


def launch_if_needed(cfg, argv: list[str]) -> int | None:
    """A data-parallel job (``cfg``: a `TrainConfig`). In the user's process: run ``argv`` under the
    launcher and return the job's exit code. In a worker (or when one plain process suffices): return
    None, the caller trains in-process."""
    if in_worker() or not needs_launcher(cfg):
        return None
    return launch(cfg.workers, argv, cfg.out, cfg.section("launch"))
