"""The scheduler: a queue with a slot budget, FIFO within a priority, higher priorities first.

States move only forward: ``queued -> running -> succeeded | failed | cancelled`` and ``queued ->
cancelled``; a retry is a NEW job (``retry_of``) with ``--resume`` when the run has a checkpoint. A job takes
``--workers`` slots plus its app's ``AppSpec.extra_slots`` flags; the queue is served strictly in order, so a
big job at the head is not starved by smaller ones behind it, and one asking for more than the budget is
refused at submit. ``tick`` (about twice a second, and when a local job ends) finalises jobs whose process
ended, escalates cancels (SIGTERM, SIGKILL after ``grace_s``) and starts what fits; ``recover`` re-adopts
live jobs (pid + start time) at start-up and finalises dead ones from ``RUN/job.exit``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mariana.platform.cli.common import subcommands
from mariana.platform.cli.outputs import foreign
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.registry import find_app
from sqlalchemy import select

from .db import Database, Job, add_event
from .executor import Executor, Handle, LocalExecutor, StartError
from .logstore import LogStore, job_files, log_error
from .resources import normalize, tasks

PRUNED = "pruned by mariana tune"  # the cancel reason of a trial the tuner's pruner stopped (no Retry)
LOGSTORE_NICE = 10  # the LogStore thread yields the CPU to training processes
REFUSED_APPS = {"jobs", "submit"}  # the service does not run its own client commands


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value of the last ``flag V`` / ``flag=V`` in argv (None if absent)."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def handle_of(job: Job) -> Handle | None:
    """The executor's handle of a started job (None before the spawn)."""
    if job.pid is None and job.external_id is None:
        return None
    return Handle(job.pid, job.pid_start, job.external_id)


def slots_of(argv: list[str]) -> int:
    def intval(flag: str, default: int) -> int:
        v = _flag_value(argv, flag)
        try:
            return max(0, int(v)) if v is not None else default
        except ValueError:
            return default  # the job reports the bad value itself

    n = intval("--workers", 1)
    spec = find_app(argv[0]) if argv else None
    for flag in spec.extra_slots if spec else ():  # e.g. parameter servers besides the workers
        n += intval(flag, 0)
    return max(1, n)


class CommandCatalog:
    """Which ``mariana <app> <cmd>`` exist and which flags they take, read from the CLI's own argparse
    tree: ``build_parser()`` -> the ``mariana`` parser (given by whoever starts the service, so the
    scheduler does not import the CLI that imports it)."""

    def __init__(self, build_parser: Callable[[], argparse.ArgumentParser] | None = None):
        self._build_parser = build_parser
        self._lock = threading.Lock()
        self._leaves: dict[tuple[str, str], set[str]] | None = None

    def leaves(self) -> dict[tuple[str, str], set[str]]:
        """{(app, command): its option strings}; ``(app, "")`` for an app without subcommands."""
        with self._lock:
            if self._leaves is None:
                if self._build_parser is None:
                    return {}
                leaves = {}
                for app, ap in subcommands(self._build_parser()).items():
                    cmds = subcommands(ap)
                    if not cmds:
                        leaves[(app, "")] = set(ap._option_string_actions)
                    for cmd, cp in cmds.items():
                        leaves[(app, cmd)] = set(cp._option_string_actions)
                self._leaves = leaves
            return self._leaves

    def check(self, argv: list[str]) -> tuple[str, str, set[str]]:
        """``(app, command, option strings)`` for a job argv, or MarianaError naming what is wrong."""
        if not argv or not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise MarianaError(
                "argv: expected a non-empty list of strings, e.g. ['mlp', 'train', '--data', 'X']"
            )
        if self._build_parser is None:
            raise MarianaError(
                "this scheduler was started without the CLI's parser (build_parser): it takes no jobs"
            )
        leaves = self.leaves()
        app = argv[0]
        apps = sorted({a for a, _ in leaves} - REFUSED_APPS)
        if app not in apps:
            raise MarianaError(f"unknown app {app!r}: expected one of {', '.join(apps)}")
        if (app, "") in leaves:
            return app, "", leaves[(app, "")]
        cmds = sorted(c for a, c in leaves if a == app)
        cmd = argv[1] if len(argv) > 1 else ""
        if (app, cmd) not in leaves:
            raise MarianaError(f"unknown command {app} {cmd!r}: expected one of {', '.join(cmds)}")
        return app, cmd, leaves[(app, cmd)]


class Scheduler:
    def __init__(
        self,
        db: Database,
        home: Path,
        slots: int,
        executor: Executor | None = None,
        grace_s: float = 10.0,
        interval_s: float = 0.5,
        build_parser: Callable[[], argparse.ArgumentParser] | None = None,
        check: Callable[[list[str], str, int], None] | None = None,
    ):
        """``build_parser()`` -> the ``mariana`` argparse tree submitted argvs are checked against;
        ``check(argv, cwd, tasks)``: the command's own checks before it trains (`cli.main.check_command`)."""
        self.db = db
        self.home = Path(home)
        self.slots = slots
        self.executor = executor or LocalExecutor()
        if isinstance(self.executor, LocalExecutor):
            self.executor.on_exit = self.wake  # a job that ends wakes the loop: its slot frees at once
        self.logstore = LogStore(db)
        self.catalog = CommandCatalog(build_parser)
        self.check = check
        self.grace_s = grace_s
        self.interval_s = interval_s
        self._cancel_at: dict[int, float] = {}  # job id -> time of SIGTERM
        self._stop = threading.Event()
        self._wake_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._tail_thread: threading.Thread | None = None
        self._tick_lock = threading.Lock()
        self.last_error: str | None = None

    # ------------------------------------------------------------------ API operations
    def submit(self, argv: list[str], priority: int = 0, name: str = "", cwd: str = "", retry_of=None,
               resources: dict | None = None) -> Job:  # fmt: skip
        app, cmd, options = self.catalog.check(argv)
        resources = normalize(resources)
        self.executor.check(resources, options)
        slots = slots_of(argv)
        if slots > self.slots:
            raise MarianaError(
                f"the job asks for {slots} slots (--workers/--servers) but this service has only "
                f"{self.slots} (start it with a larger --slots)"
            )
        cwd = cwd or os.getcwd()
        if not Path(cwd).is_dir():
            raise MarianaError(f"cwd {cwd}: no such directory on the service's host")
        if self.check is not None:
            try:
                self.check(list(argv), cwd, tasks(resources))
            except SystemExit as e:  # argparse printed its usage and error (to the service's log), or --help
                if e.code:
                    raise MarianaError(
                        f"{' '.join(argv[:2])}: the flags do not parse (see `--help`)"
                    ) from None
        with self.db.write() as s:
            job = Job(
                name=name or "",
                app=app,
                command=cmd,
                argv=list(argv),
                cwd=cwd,
                state="queued",
                priority=int(priority),
                slots=slots,
                created=time.time(),
                retry_of=retry_of,
                resources=resources,
                executor=self.executor.name,
            )
            s.add(job)
            s.flush()  # assigns the id
            out = _flag_value(argv, "--out")
            if out is None and "--out" in options:
                out = str(self.home / "runs" / f"job-{job.id}")
                job.argv = [*argv, "--out", out]
            job.run_dir = str(Path(cwd, out).resolve()) if out else str(self.home / "runs" / f"job-{job.id}")
            add_event(s, job.id, "queued", f"submitted ({slots} slot(s), priority {priority})")
        self.wake()
        return job

    def cancel(self, job_id: int, reason: str | None = None) -> Job:
        """Cancel a queued or running job; ``reason`` (e.g. ``PRUNED``) becomes the job's ``error`` line."""
        with self.db.write() as s:
            job = s.get(Job, job_id)
            if job is None:
                raise KeyError(job_id)
            if job.state == "queued":
                job.state, job.ended, job.error = "cancelled", time.time(), reason
                add_event(s, job.id, "cancelled", reason or "cancelled while queued")
                return job
            if job.state != "running" or job.cancel_requested:
                return job
            job.cancel_requested, job.error = True, reason
            add_event(s, job.id, "cancelling", "SIGTERM to the job's process group")
            handle = handle_of(job)
        if handle is not None:
            self._cancel_at[job_id] = time.time()
            self.executor.terminate(handle)
        self.wake()
        return job

    def retry(self, job_id: int) -> Job:
        with self.db.read() as s:
            job = s.get(Job, job_id)
            if job is None:
                raise KeyError(job_id)
            if job.state not in ("failed", "cancelled"):
                raise MarianaError(
                    f"job {job_id} is {job.state}: only failed or cancelled jobs can be retried"
                )
            argv, priority, name, cwd = list(job.argv), job.priority, job.name, job.cwd
            resources = job.resources or {}
            has_checkpoint = (Path(job.run_dir) / "checkpoints" / "latest").is_file()
        _, _, options = self.catalog.check(argv)
        # --resume continues from the run's checkpoint; a run that died before its first checkpoint
        # starts again from scratch (the training commands refuse --resume without a checkpoint).
        if "--resume" in options and "--resume" not in argv and has_checkpoint:
            argv.append("--resume")
        return self.submit(argv, priority, name, cwd, retry_of=job_id, resources=resources)

    # ------------------------------------------------------------------ the loop
    def start(self) -> None:
        # Building the CLI's parser tree imports every app (torch included): do it now, off the request path.
        threading.Thread(target=self.catalog.leaves, name="mariana-catalog", daemon=True).start()
        self.recover()
        self._thread = threading.Thread(target=self._loop, name="mariana-scheduler", daemon=True)
        self._thread.start()
        self._tail_thread = threading.Thread(target=self._tail_loop, name="mariana-logstore", daemon=True)
        self._tail_thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake_event.set()
        for t in (self._thread, self._tail_thread):
            if t is not None:
                t.join(timeout=10)

    def wake(self) -> None:
        self._wake_event.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
                self.last_error = None
            except Exception as e:  # keep scheduling; the error is visible on /healthz
                self.last_error = f"{type(e).__name__}: {e}"
            self._wake_event.wait(self.interval_s)
            self._wake_event.clear()

    def _tail_loop(self) -> None:
        """The LogStore's thread: copies every running job's new records into the database.

        It runs at a lower CPU priority than the jobs (Linux: per-thread nice), so on a machine whose cores
        are all training, the copying waits for gaps instead of preempting a training thread. Jobs are
        started by the scheduler thread, so they keep the normal priority."""
        if sys.platform == "linux":
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOGSTORE_NICE)
            except OSError:
                pass
        while not self._stop.is_set():
            try:
                with self.db.read() as s:
                    running = list(s.scalars(select(Job.id).where(Job.state == "running")))
                for job_id in running:
                    self.logstore.ingest(job_id)
            except Exception as e:  # keep tailing; the error is visible on /healthz
                self.last_error = f"{type(e).__name__}: {e}"
            self._stop.wait(self.interval_s)

    def tick(self) -> None:
        with self._tick_lock:
            with self.db.read() as s:
                running = list(s.scalars(select(Job).where(Job.state == "running")))
            for job in running:
                self._watch(job)
            self._start_queued()

    def _watch(self, job: Job) -> None:
        handle = handle_of(job)
        if handle is None:  # the service died between "running" and the spawn
            self._finish(job, None, "the service stopped while starting this job")
            return
        if (job.executor or "local") != self.executor.name:
            self._finish(job, None, f"started by the {job.executor} executor; this service runs "
                         f"{self.executor.name} jobs and cannot watch it")  # fmt: skip
            return
        rc = self.executor.poll(handle, job_files(self.home, job))
        if rc is None:
            t = self._cancel_at.get(job.id)
            if job.cancel_requested and t is None:  # e.g. a cancel from before a service restart
                self.executor.terminate(handle)
                self._cancel_at[job.id] = time.time()
            elif job.cancel_requested and time.time() - t > self.grace_s:
                self.executor.kill(handle)
                self._cancel_at[job.id] = time.time()
            return
        self._finish(job, rc)

    def _finish(self, job: Job, rc: int | None, error: str | None = None) -> None:
        self.logstore.finalize(job.id)
        if handle_of(job) is not None and hasattr(self.executor, "forget"):
            self.executor.forget(handle_of(job))
        self._cancel_at.pop(job.id, None)
        with self.db.write() as s:
            j = s.get(Job, job.id)
            if j.state != "running":
                return
            if rc == -1000:
                rc, error = None, error or "the job's process ended without recording an exit status"
            if j.cancel_requested:
                state, error = "cancelled", error or j.error  # keeps a cancel's reason (PRUNED)
            elif rc == 0:
                state = "succeeded"
            else:
                state = "failed"
                error = error or log_error(job_files(self.home, j), j.log_offset) or f"exit status {rc}"
            ended = time.time()
            try:  # the runner wrote job.exit when the job ended (maybe while the service was down)
                exited = (job_files(self.home, j) / "job.exit").stat().st_mtime
                ended = min(ended, max(exited, j.started or 0))
            except FileNotFoundError:
                pass
            j.state, j.exit_code, j.ended, j.error = state, rc, ended, error
            add_event(s, j.id, state, f"exit status {rc}" + (f": {error}" if error else ""))

    def _start_queued(self) -> None:
        with self.db.read() as s:
            used = sum(s.scalars(select(Job.slots).where(Job.state == "running")))
            queued = list(
                s.scalars(select(Job).where(Job.state == "queued").order_by(Job.priority.desc(), Job.id))
            )
        for job in queued:
            if used + job.slots > self.slots:
                break  # strict order: the head waits for its slots, nothing overtakes it
            if self._launch(job):
                used += job.slots

    def _launch(self, job: Job) -> bool:
        run_dir = Path(job.run_dir)
        if foreign(run_dir):  # the user's folder: the command refuses it (or writes with --force), we never
            run_dir = self.home / "logs" / f"job-{job.id}"
        run_dir.mkdir(parents=True, exist_ok=True)
        log = run_dir / "job.log"
        offset = log.stat().st_size if log.exists() else 0
        with self.db.write() as s:
            j = s.get(Job, job.id)
            if j.state != "queued":
                return False
            j.state, j.started, j.log_offset = "running", time.time(), offset
            add_event(s, j.id, "running", f"{j.slots} slot(s)")
        env = {k: v for k, v in os.environ.items() if k != "MARIANA_JOBS_TOKEN"}
        env.update({"PYTHONUNBUFFERED": "1", "MARIANA_JOB_ID": str(job.id)})
        try:
            handle = self.executor.start(job.id, list(job.argv), run_dir, job.cwd, env, job.resources or {})
        except (OSError, StartError) as e:
            with self.db.write() as s:
                j = s.get(Job, job.id)
                j.state, j.ended, j.error = "failed", time.time(), f"could not start the job: {e}"
                add_event(s, j.id, "failed", j.error)
            return False
        with self.db.write() as s:
            j = s.get(Job, job.id)
            j.pid, j.pid_start, j.external_id = handle.pid, handle.start, handle.ext
            if handle.ext:
                add_event(s, j.id, "running", f"submitted as {self.executor.describe(handle)}")
        return True

    def recover(self) -> None:
        """After a restart: re-adopt running jobs that are still alive, finalise the others."""
        with self.db.read() as s:
            running = list(s.scalars(select(Job).where(Job.state == "running")))
        for job in running:
            handle = handle_of(job)
            same = (job.executor or "local") == self.executor.name
            if handle is not None and same and self.executor.alive(handle):
                with self.db.write() as s:
                    what = self.executor.describe(handle)
                    add_event(s, job.id, "running", f"re-adopted {what} after a service restart")
                continue
            self._watch(job)  # reads the remaining records, job.exit and finalises
