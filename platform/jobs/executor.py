"""Where jobs run: the `Executor` interface and `LocalExecutor` (process groups on this host).

The scheduler only talks to an `Executor`: ``check`` refuses at submit (MarianaError, one line) what it
cannot honour; ``start`` returns a `Handle` whose ``pid`` + ``start`` (the process start time from
``/proc/PID/stat``) or ``ext`` (a cluster's job id) are stored in the database, or raises `StartError` with
the cluster's message; ``poll`` -> None while the job runs, else its exit status; ``alive`` re-adopts jobs
after a service restart; a cancel sends ``terminate``, then ``kill`` after a grace period.

`LocalExecutor` runs each job under `runner.run`, a child of a fork server (torch and the commands imported
once) in a new session (its own process group, so it survives the service and a cancel reaches every
process of the group), output appended to ``RUN/job.log``, exit status in ``RUN/job.exit``. torchrun
starts its workers in sessions of their own, so terminate/kill also signal every descendant found under the
job's process (remembered at the first signal, identified by pid + start time). It runs one task on this
host. `SlurmExecutor`: ``slurm.py``. Run directories must be on storage the service can read, since the
LogStore tails files there.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from mariana.platform.core.errors import MarianaError

from ..runtime.launch import descendants, proc_stat, process_alive
from . import runner
from .resources import describe


@dataclass
class Handle:
    pid: int | None
    start: int | None
    ext: str | None = None  # a cluster scheduler's job id (Slurm), None for local processes


class StartError(RuntimeError):
    """The cluster refused the job at submission (e.g. sbatch's error): the job fails with this message."""


class Executor:
    """Interface every executor implements (see the module docstring)."""

    name = "local"
    default_slots: int | None = None  # None: the service's core count

    def check(self, resources: dict, options: set[str]) -> None:
        """Raise MarianaError (one line) if this executor cannot honour ``resources``."""

    def start(self, job_id: int, argv: list[str], run_dir: Path, cwd: str, env: dict[str, str],
              resources: dict | None = None) -> Handle:  # fmt: skip
        raise NotImplementedError

    def describe(self, handle: Handle) -> str:
        """How events name the job's process: ``pid 123`` or ``Slurm job 45``."""
        return f"pid {handle.pid}"

    def poll(self, handle: Handle, run_dir: Path) -> int | None:
        raise NotImplementedError

    def alive(self, handle: Handle) -> bool:
        raise NotImplementedError

    def terminate(self, handle: Handle) -> None:
        raise NotImplementedError

    def kill(self, handle: Handle) -> None:
        raise NotImplementedError


def local_gpu_count() -> int:
    """NVIDIA GPUs on this host (their /dev/nvidiaN device files; no CUDA initialisation)."""
    return sum(1 for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit())


def read_exit_file(run_dir: Path) -> int | None:
    try:
        return int((Path(run_dir) / "job.exit").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


class LocalExecutor(Executor):
    """Jobs as process groups on this host (see the module docstring)."""

    def __init__(self):
        self._procs: dict[int, multiprocessing.Process] = {}  # pid -> a runner we started (reaped by poll)
        multiprocessing.set_forkserver_preload(
            ["torch", "torch._dynamo", "mariana.platform.cli.main", runner.__name__]
        )
        self._tree: dict[int, set[tuple[int, int]]] = {}  # pid -> descendants seen at terminate
        self._lock = threading.Lock()
        self.on_exit = None  # called (no arguments) when a job's runner ends: the scheduler's wake

    def check(self, resources: dict, options: set[str]) -> None:
        bad = {k: v for k, v in resources.items() if k in ("nodes", "tasks_per_node", "time", "partition")}
        if bad:
            raise MarianaError(
                f"{describe(bad)}: the local executor runs one task on the service's host without a time "
                "limit; start the service with --executor slurm for multi-node jobs, partitions and limits"
            )
        gpus, cpus = resources.get("gpus_per_node", 0), resources.get("cpus_per_task", 1)
        if gpus > local_gpu_count():
            raise MarianaError(f"--gpus-per-node {gpus}: this host has {local_gpu_count()} GPU(s)")
        if cpus > (os.cpu_count() or 1):
            raise MarianaError(f"--cpus-per-task {cpus}: this host has {os.cpu_count()} CPU(s)")

    def start(self, job_id: int, argv: list[str], run_dir: Path, cwd: str, env: dict[str, str],
              resources: dict | None = None) -> Handle:  # fmt: skip
        run_dir.mkdir(parents=True, exist_ok=True)
        args = (str(run_dir / "job.exit"), argv, cwd, env, str(run_dir / "job.log"))
        proc = multiprocessing.get_context("forkserver").Process(
            target=runner.run, args=args, name=f"job {job_id}"
        )
        proc.start()
        multiprocessing.process._children.discard(proc)  # not joined (nor killed) when the service exits
        st = proc_stat(proc.pid)
        with self._lock:
            self._procs[proc.pid] = proc
        if self.on_exit is not None:
            threading.Thread(target=self._notify_exit, args=(proc,), daemon=True).start()
        return Handle(proc.pid, st[2] if st else None)

    def _notify_exit(self, proc: multiprocessing.Process) -> None:
        """Call ``on_exit`` when a runner ends, so its slot is given to the next job at once instead of at the
        scheduler's next tick (`poll` then reads its status; ``proc`` held here keeps its sentinel open)."""
        multiprocessing.connection.wait([proc.sentinel])
        self.on_exit()

    def poll(self, handle: Handle, run_dir: Path) -> int | None:
        with self._lock:
            proc = self._procs.get(handle.pid)
        if proc is not None:
            rc = proc.exitcode
            if rc is None:
                return None
            with self._lock:
                self._procs.pop(handle.pid, None)
            code = read_exit_file(run_dir)
            return code if code is not None else rc
        # Adopted after a restart: not our child, so the exit file is the only record of its status.
        if process_alive(handle.pid, handle.start):
            return None
        code = read_exit_file(run_dir)
        return code if code is not None else -1000  # died without a status (e.g. SIGKILL of the runner)

    def alive(self, handle: Handle) -> bool:
        return process_alive(handle.pid, handle.start)

    def _signal(self, handle: Handle, sig: int) -> None:
        tree = self._tree.setdefault(handle.pid, set())
        if process_alive(handle.pid, handle.start):
            tree.update(descendants(handle.pid))
            try:
                os.killpg(handle.pid, sig)  # the runner is its session's leader: pgid == pid
            except (ProcessLookupError, PermissionError):
                pass
        _kill_live(tree, sig)

    def terminate(self, handle: Handle) -> None:
        self._signal(handle, signal.SIGTERM)

    def kill(self, handle: Handle) -> None:
        self._signal(handle, signal.SIGKILL)

    def forget(self, handle: Handle) -> None:
        _kill_live(self._tree.pop(handle.pid, ()), signal.SIGKILL)


def _kill_live(procs, sig: int) -> None:
    """Send ``sig`` to each (pid, start time) of ``procs`` that is still that process."""
    for pid, start in list(procs):
        if process_alive(pid, start):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
