"""The platform's one launcher: N local processes through torchrun's agent (torch.distributed.run).

Every multi-process job starts here: the data-parallel jobs (`launch_if_needed`, called by
``mariana <app> train --workers N``) and the parameter-server jobs (`mariana.platform.ps.master.run_job`,
S servers + W workers). `launch` runs torchrun's agent in this process with c10d rendezvous on a free
loopback port or on a given ``HOST:PORT`` for several nodes, workers forked from a server that imported
torch once (`fork_server`), restarts of the whole group, per-rank logs (``RUN/logs/rank-R.log``,
`workerio`; the agent's in ``launcher.log``) and one console line per failed process (the console, failure
and Ctrl-C behaviour: ``platform/README.md``, "Data parallel"); exit code 2 when every failed process
reported bad input, else 1. Inside a process the launcher started, `in_worker` is true and the command
trains instead of launching.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import runpy
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from ..core.endpoint import is_this_host, split_endpoint, wait_s
from ..core.jsonfile import read_json
from . import workerio

CLI_MODULE = "mariana.platform.cli"
_OPENMP = re.compile(r"/lib(g|i)?omp[^/]*\.so[^/]*$")  # GNU, Intel and LLVM OpenMP
_STOPPED: list[BaseException] = []  # launches a signal stopped, kept until this process ends (`run_torchrun`)


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
    """The rendezvous' settings: a node that has not joined within the wait ends it; this node hosts the store
    when the endpoint is an address of its interfaces that torch's guess (the hostname's) misses. Where torch guesses
    right it keeps its fallback: a second agent on the node, finding the port taken, joins as a client (Slurm)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    host = split_endpoint(endpoint)[0]
    second_interface = is_this_host(host) and not _matches_machine_hostname(host)
    return {"join_timeout": max(1, int(wait_s()))} | ({"is_host": True} if second_interface else {})


def stall_reports(run_dir: str | Path) -> list[dict]:
    reports = sorted((Path(run_dir) / "logs").glob("stall-rank-*.json"))
    return [r for r in map(read_json, reports) if r is not None]


def worker_threads(nproc_per_node: int) -> int:
    """CPU threads per worker when ``nproc_per_node`` processes share this machine (at least 1)."""
    return max(1, (os.cpu_count() or 1) // max(1, nproc_per_node))


def _quiet_launcher_logs(run_dir: Path) -> None:
    """torchrun's agent logs go to ``RUN/logs/launcher.log``, not the console (the launcher prints its own line)."""
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


def fork_is_safe() -> bool:
    """Whether this process may fork a server whose children run torch: no other Python thread (a lock it
    holds stays held), no GPU device (CUDA does not survive a fork) and no OpenMP pool (a child of a process
    that ran a parallel region hangs in its first one): no thread is running or waits in OpenMP's code."""
    if threading.active_count() > 1 or any(Path("/dev").glob("nvidia*")) or Path("/dev/kfd").exists():
        return False
    maps = Path("/proc/self/maps").read_text().splitlines()  # "start-end perms offset dev inode path"
    openmp = [[int(a, 16) for a in ln.split()[0].split("-")] for ln in maps if _OPENMP.search(ln)]
    for task in set(os.listdir("/proc/self/task")) - {str(os.getpid())}:
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            state = Path(f"/proc/self/task/{task}/syscall").read_text().split()
            if state[0] == "running" or any(lo <= int(state[-1], 16) < hi for lo, hi in openmp):
                return False
    return True


def _fork_the_server(preload: list[str]) -> None:
    """Start multiprocessing's fork server as a fork of this process: what ``ForkServer.ensure_running``
    does with a fresh interpreter (Python 3.11-3.12's protocol; later ones add a key: left to them)."""
    from multiprocessing import connection, forkserver

    import torch

    server = forkserver._forkserver
    if server._forkserver_pid is not None or hasattr(server, "_forkserver_authkey"):
        return
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server ends when every client has closed alive_w
        sys.stdout.flush()
        sys.stderr.flush()
        if (pid := os.fork()) == 0:
            try:
                os.close(alive_w)
                for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
                    signal.signal(sig, signal.SIG_DFL)  # as in a fresh interpreter
                # OpenMP read the environment when this process loaded it: OMP_NUM_THREADS as a fresh server's
                torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads()))
                forkserver.main(listener.fileno(), alive_r, preload)
            finally:
                os._exit(0)
        os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


@contextlib.contextmanager
def fork_server(log: Path, modules: tuple[str, ...] | None = None) -> Iterator[None]:
    """This launch's fork server for the block (stopped at its end: the next launch's takes its environment), with
    torch, torch._dynamo (every torch optimizer imports it) and ``modules`` (default: the command's) imported once,
    not per child: a fork of this process where `fork_is_safe`, else a fresh interpreter; the resource tracker
    writes to ``log``."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    loaded = sorted(m for m in sys.modules if m.startswith("mariana.") and not m.endswith("__main__"))
    preload = ["torch", "torch.distributed", "torch._dynamo", *(loaded if modules is None else modules)]
    multiprocessing.set_forkserver_preload(preload)
    with open(log, "a") as f:
        console = os.dup(2)
        os.dup2(f.fileno(), 2)
        multiprocessing.resource_tracker.ensure_running()
        os.dup2(console, 2)
        os.close(console)
    if fork_is_safe():
        _fork_the_server(preload)
    try:
        yield
    finally:
        multiprocessing.forkserver._forkserver._stop()


def forked_worker(argv: list, env: dict | None = None, log: str | None = None) -> None:
    """One worker, a child of the fork server: ``python -u -m mariana.platform.cli argv`` in a session of
    its own (as torchrun's workers: Ctrl-C reaches the agent, which stops them). A tuner's trial also gives its
    environment ``env`` (``OMP_NUM_THREADS``: torch's threads) and the file its stdout and stderr append to."""
    import ctypes

    # PR_SET_PDEATHSIG 0, as torchrun's workers: the fork server's end (a signal to the group) is not ours
    ctypes.CDLL(None).prctl(1, 0)
    os.setsid()
    if log is not None:
        output_to(log, env)
    run_cli_module(argv)


def output_to(log: str, env: dict) -> None:
    """For a child of a fork server: its stdout and stderr appended to ``log`` (its files, not a caller's
    replacement of sys.stdout), its environment exactly ``env`` and torch's threads from its
    ``OMP_NUM_THREADS`` (OpenMP read the environment when the fork server loaded it)."""
    import torch

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)
    sys.stdout, sys.stderr = (open(n, "w", encoding="utf-8", closefd=False) for n in (1, 2))
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or torch.get_num_threads()))


def run_cli_module(argv: list) -> None:
    """``mariana argv`` here, as ``python -u -m mariana.platform.cli`` runs it (its SystemExit raised)."""
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    sys.argv = [CLI_MODULE, *argv]
    runpy.run_module(CLI_MODULE, run_name="__main__", alter_sys=True)


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


def watch(run_dir: Path, lost: dict, done: threading.Event, progress: Callable[[], str] | None) -> None:
    """The launcher's thread until ``done``: ``mariana: <progress()>`` on stderr every ``$MARIANA_PROGRESS_EVERY``
    seconds (30; nothing while it returns ''; ``progress`` None: never); once a rank of this host reports a lost
    host (`watchdog.exit_lost`), its message in ``lost`` and a SIGTERM to this process: torchrun's agent stops
    its workers, no restart (README, "A lost host / link down"); if the agent is stuck in a store call to the
    lost host, kill the workers and exit 1 here."""
    me, shown = (socket.gethostname(), os.getpid()), time.monotonic()
    every = float(os.environ.get(workerio.PROGRESS_EVERY_ENV) or 30)
    while not done.wait(0.25):
        if progress and time.monotonic() - shown >= every and (text := progress()):
            shown = time.monotonic()
            print(f"mariana: {text}", file=sys.stderr, flush=True)
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


def run_torchrun(config, argv: list[str], run_dir: str | Path, console_rank: int = 0, progress=None):
    """Run torchrun's agent (``config``: `launch_config`) in this process, its workers running ``mariana
    argv``; returns None on success, the ``ChildFailedError`` of a failed job, or the message of a lost host.
    Ctrl-C (or SIGTERM) stops the workers and raises KeyboardInterrupt.

    Workers get ``OMP_NUM_THREADS`` (unless set) and the run directory, so their output goes to
    ``RUN/logs/rank-R.log`` (see `workerio`); ``console_rank`` keeps its progress bar on the terminal;
    ``progress``: a line for the console now and then while the job runs (`watch`), or None."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    run_dir = Path(run_dir).absolute()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if not os.environ.get("OMP_NUM_THREADS"):  # else torchrun sets 1 and prints a banner about it
        os.environ["OMP_NUM_THREADS"] = str(worker_threads(config.nproc_per_node))
    os.environ[workerio.RUN_DIR_ENV] = str(run_dir)
    os.environ[workerio.AGENT_ENV] = str(os.getpid())
    os.environ[workerio.CONSOLE_RANK_ENV] = str(console_rank)
    # the workers' stderr is a pipe to this agent: they draw a progress bar only when this one is a terminal
    os.environ[workerio.CONSOLE_TTY_ENV] = "1" if sys.stderr.isatty() else "0"
    _quiet_launcher_logs(run_dir)
    lost, done = {}, threading.Event()
    try:
        with fork_server(run_dir / "logs" / "launcher.log"):  # before any thread: it may fork this process
            threading.Thread(target=watch, args=(run_dir, lost, done, progress), daemon=True).start()
            elastic_launch(config=config, entrypoint=forked_worker)(argv)
    except SignalException as e:
        # Kept: its frames hold the agent's rendezvous handler; freed where its keep-alive thread held the last
        # reference, torch's timer finalizer would join that thread from itself ("cannot join current thread").
        _STOPPED.append(e)
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


def _first_failure(run_dir: str | Path, failures: dict, nproc: int) -> dict[int, int]:
    """Global rank -> exit code of the failed worker to name. torchrun's agent reports the first worker whose
    exit it saw, which may have failed because another did (gloo's "connection closed"): when that worker
    left a record (an error or a watchdog report), name the worker of this node whose record came first."""
    rank, f = next(iter(failures.items()))
    logs, base = Path(run_dir) / "logs", int(rank) - f.local_rank
    made = {r: p.stat().st_mtime for r in range(base, base + nproc) for p in logs.glob(f"*-rank-{r}.json")}
    first = min(made, key=made.get) if int(rank) in made else int(rank)
    return {first: f.exitcode if first == int(rank) else 1}


def report_failure(e, run_dir: str | Path, max_restarts: int = 0, name=None, nproc_per_node: int = 1) -> int:
    """Print one console line per cause of a failed job (``e``: torchrun's ChildFailedError; ``name``:
    rank -> how to name that process, default ``worker rank R``); returns the exit code: 2 when every
    failed process reported bad input, else 1."""
    codes = _first_failure(run_dir, e.failures, nproc_per_node)
    # A watchdog's report (a stall, a lost host) replaces its rank's exit code; reports of other nodes' ranks
    # (a shared run directory) are theirs to print.
    why = {
        rep["rank"]: rep.get("message", "watchdog") for rep in stall_reports(run_dir) if rep["rank"] in codes
    }
    lines, all_user = workerio.failure_lines(run_dir, {r: c for r, c in codes.items() if r not in why}, name)
    lines += [f"{m} (see {run_dir}/logs/)" for m in why.values()]
    for line in lines:
        print(f"mariana: error: {line}", file=sys.stderr)
    if max_restarts > 0 and not all_user:
        print(f"mariana: error: the job still failed after {max_restarts} restart(s)", file=sys.stderr)
    return 2 if all_user else 1


def launch(nproc_per_node: int, argv: list[str], run_dir: str | Path, at, *, what="", console_rank=0, name=None,
           progress=None) -> int:  # fmt: skip
    """Run ``mariana argv`` in ``nproc_per_node`` processes on this node (of the nodes of ``at``, see
    `launch_config`) under torchrun and return the job's exit code (0, or `report_failure`'s after printing
    the cause). ``what``: the processes, for the launch's line; ``name``: see `report_failure`; ``progress``:
    see `run_torchrun`."""
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError

    config = launch_config(nproc_per_node, at)
    nnodes, restarts = config.max_nodes, config.max_restarts
    what = what or f"{nproc_per_node} worker(s) x {nnodes} node(s)"
    print(f"mariana: launching {what} through torchrun (max restarts {restarts}); logs in {run_dir}/logs/",
          file=sys.stderr, flush=True)  # fmt: skip
    try:
        failure = run_torchrun(config, argv, run_dir, console_rank, progress)
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
