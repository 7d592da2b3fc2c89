"""How a trial's ``mariana <app> train`` runs: a local process group, or a job of the job service.

Both give the same interface: ``start(argv, run_dir) -> handle`` (a JSON-able dict, stored in the trial's
user attributes so a resumed tuner can stop what a killed one left running), ``poll(handle) -> None`` while
running else ``(ok, error)``, ``cancel(handle)`` and ``stop_stale(handle)``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from pathlib import Path

from mariana.platform.runtime.launch import forked_worker, proc_stat, process_alive

LOG_NAME = "trial.log"  # a local trial's stdout + stderr, inside its run directory


def last_error_line(text: str) -> str:
    """The last ``mariana: error: ...`` line of a log (else its last non-empty line, else '')."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("mariana: error:"):
            return ln[len("mariana: error:") :].strip()
    return lines[-1][-300:] if lines else ""


class LocalRunner:
    """Trials as children of the tuner's fork server (`launch.fork_server`, entered by the tuner: torch and the
    app imported once, not per trial), each in its own session (a cancel reaches the whole group, torchrun
    workers included). Each gets ``threads`` torch threads so P trials share the cores."""

    kind = "local"

    def __init__(self, threads: int):
        self.threads = threads
        self.procs: dict[int, multiprocessing.Process] = {}

    def start(self, argv: list[str], run_dir: Path, name: str) -> dict:
        run_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("OMP_NUM_THREADS", str(self.threads))
        proc = multiprocessing.get_context("forkserver").Process(
            target=forked_worker, args=(argv, env, str(run_dir / LOG_NAME)), name=name
        )
        proc.start()
        self.procs[proc.pid] = proc
        st = proc_stat(proc.pid)
        return {
            "runner": "local",
            "pid": proc.pid,
            "pid_start": st[2] if st else None,
            "run_dir": str(run_dir),
        }

    def poll(self, handle: dict) -> tuple[bool, str] | None:
        proc = self.procs.get(handle["pid"])
        rc = proc.exitcode if proc is not None else -1
        if rc is None:
            return None
        self.procs.pop(handle["pid"], None)
        if rc == 0:
            return True, ""
        try:
            text = (Path(handle["run_dir"]) / LOG_NAME).read_text(errors="replace")
        except OSError:
            text = ""
        return False, last_error_line(text) or f"exit status {rc}"

    def cancel(self, handle: dict, reason: str | None = None) -> None:
        _kill_group(handle["pid"], handle.get("pid_start"), signal.SIGTERM)

    def wait_cancelled(self, handle: dict, timeout: float = 10.0) -> None:
        proc = self.procs.pop(handle["pid"], None)
        if proc is None:
            return
        proc.join(timeout)
        if proc.exitcode is None:
            _kill_group(handle["pid"], handle.get("pid_start"), signal.SIGKILL)
            proc.join()

    def stop_stale(self, handle: dict) -> None:
        """A trial left running by a killed tuner: SIGKILL its process group (it will be run again)."""
        if handle.get("runner") == "local":
            _kill_group(handle["pid"], handle.get("pid_start"), signal.SIGKILL)


def _kill_group(pid: int, start: int | None, sig: int) -> None:
    if not process_alive(pid, start):
        return
    # the trial (even before its setsid), then its session's group: torchrun's workers too
    for kill in (os.kill, os.killpg):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, sig)


class JobRunner:
    """Trials as jobs of a running job service (``mariana jobs serve``): visible in its UI, cancellable
    there, started within its slot budget."""

    kind = "jobs"

    def __init__(self, client, study_name: str):
        self.client = client
        self.study_name = study_name

    def start(self, argv: list[str], run_dir: Path, name: str) -> dict:
        job = self.client.submit(argv, name=f"{self.study_name} {name}", cwd=os.getcwd())
        return {"runner": "jobs", "job_id": job["id"], "run_dir": str(run_dir)}

    def poll(self, handle: dict) -> tuple[bool, str] | None:
        job = self.client.job(handle["job_id"])
        if job["state"] in ("queued", "running"):
            return None
        if job["state"] == "succeeded":
            return True, ""
        if job["state"] == "cancelled":
            return False, "cancelled through the job service"
        return False, job.get("error") or f"exit status {job.get('exit_code')}"

    def cancel(self, handle: dict, reason: str | None = None) -> None:
        self.client.cancel(handle["job_id"], reason)

    def wait_cancelled(self, handle: dict, timeout: float = 10.0) -> None:
        pass  # the service escalates to SIGKILL itself

    def stop_stale(self, handle: dict) -> None:
        if handle.get("runner") == "jobs":
            job = self.client.job(handle["job_id"])
            if job["state"] in ("queued", "running"):
                self.client.cancel(handle["job_id"])
        elif handle.get("runner") == "local":
            _kill_group(handle["pid"], handle.get("pid_start"), signal.SIGKILL)
