"""The job service: ``create_app(home, db_url, slots, token)`` -> a FastAPI app with the REST API, the web
UI (``ui.py``, when present) and the scheduler thread (started and stopped with the app's lifespan).

REST API (JSON; ``/docs`` documents it):

- ``POST /api/jobs`` ``{"argv": [...], "priority": 0, "name": "", "cwd": ""}`` -> 201 job object;
  ``GET /api/jobs`` -> ``{"jobs": [...]}`` newest first; ``GET /api/jobs/{id}`` -> job + config + counters.
- ``GET /api/jobs/{id}/metrics?after=SEQ``, ``/counters``, ``/logs?tail=N`` (or ``?offset=BYTES``),
  ``/events``, ``/files/{path}`` (inside the run directory only).
- ``POST /api/jobs/{id}/cancel|retry|serve``, ``POST /api/jobs/{id}/serve/stop``; ``GET /healthz``.
- Request bodies are capped at ``MAX_BODY`` bytes (413, body unread) and a job's argv at ``MAX_ARGV``.

Auth: with a token configured, every mutating request (anything but GET/HEAD/OPTIONS) needs
``Authorization: Bearer TOKEN`` (401 otherwise), and so do ``/api`` reads from other hosts than loopback.
"""

from __future__ import annotations

import hmac
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Body, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from mariana.platform.core.config import read_config_values
from mariana.platform.core.errors import MarianaError
from pydantic import BaseModel, Field, field_validator
from sqlalchemy import select

from .db import CounterRecord, Database, Job, JobEvent, MetricRecord, default_url
from .scheduler import PRUNED, Scheduler

LOOPBACK = {"127.0.0.1", "::1", "localhost", "testclient"}
MAX_BODY = 1 << 20  # bytes of one request body (a job's argv and options; files are never uploaded)
MAX_ARGV = 64 << 10  # bytes of a job's argv, all arguments together


class BodyLimit:
    """ASGI middleware: a request whose body exceeds ``limit`` bytes gets 413 with a one-line message (the
    body is neither parsed nor echoed). Checks Content-Length up front and reads a chunked body up to the limit."""

    def __init__(self, app, limit: int = MAX_BODY):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.limit:
            return await self._refuse(send)
        chunks, seen, more = [], 0, True
        while more:  # read the whole body first (at most `limit` bytes), then hand it on in one message
            msg = await receive()
            if msg["type"] != "http.request":
                return await self.app(scope, _replay([msg], receive), send)
            chunks.append(msg.get("body", b""))
            seen, more = seen + len(chunks[-1]), msg.get("more_body", False)
            if seen > self.limit:
                return await self._refuse(send)
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(self, send):
        body = f'{{"detail": "request body too large (limit {self.limit} bytes)"}}'.encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list, receive):
    """An ASGI ``receive`` that returns ``messages`` first, then defers to ``receive``."""

    async def replay():
        return messages.pop(0) if messages else await receive()

    return replay


class SubmitRequest(BaseModel):
    argv: list[str] = Field(
        ..., description="the job's command line after `mariana`, e.g. ['mlp', 'train', ...]"
    )
    priority: int = Field(0, description="higher runs first; FIFO within a priority")
    name: str = Field("", description="a label for the job")
    cwd: str = Field("", description="directory relative paths in argv refer to (default: the service's)")
    resources: dict = Field({}, description="nodes, tasks_per_node, gpus_per_node, cpus_per_task, time, "
                            "partition (see platform/jobs/resources.py); the executor refuses what it cannot honour")  # fmt: skip

    @field_validator("argv")
    @classmethod
    def _argv_size(cls, argv: list[str]) -> list[str]:
        size = sum(len(a.encode()) + 1 for a in argv)
        if size > MAX_ARGV:
            raise ValueError(f"argv is {size} bytes; the limit is {MAX_ARGV}")
        return argv


class CancelRequest(BaseModel):
    reason: str | None = Field(None, max_length=500, description="why (kept as the job's error line)")


def view(job: Job, now: float | None = None) -> dict:
    """The REST job object, plus ``pruned``: a tuning trial its pruner stopped (shown as "pruned")."""
    out = job.to_dict(now)
    out["pruned"] = job.state == "cancelled" and (job.error or "").startswith(PRUNED)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _confined(run_dir: str, rel: str) -> Path:
    """``run_dir/rel`` if it stays inside ``run_dir`` (symlinks resolved), else 404."""
    root = Path(run_dir).resolve()
    try:
        p = (root / rel).resolve()
    except (OSError, RuntimeError):
        raise HTTPException(404, "no such file") from None
    if not p.is_relative_to(root) or not p.is_file():
        raise HTTPException(404, f"no such file in the job's run directory: {rel}")
    return p


def create_app(home: str | Path, db_url: str | None = None, slots: int | None = None, token: str | None = None,
               grace_s: float = 10.0, executor=None) -> FastAPI:  # fmt: skip
    """The service for jobs under ``home`` (run directories in ``home/runs``), database ``db_url``
    (default SQLite ``home/jobs.db``), ``slots`` (default the core count), optional bearer ``token``."""
    home = Path(home).expanduser().resolve()
    (home / "runs").mkdir(parents=True, exist_ok=True)
    db = Database(db_url or default_url(home))
    slots = slots or getattr(executor, "default_slots", None) or os.cpu_count() or 1
    sched = Scheduler(db, home, slots, executor=executor, grace_s=grace_s)  # executor None: LocalExecutor
    servers: dict[int, tuple[subprocess.Popen, str]] = {}
    servers_lock = threading.Lock()

    @asynccontextmanager
    async def lifespan(app):
        sched.start()
        try:
            yield
        finally:
            sched.stop()
            for proc, _ in servers.values():  # model servers started from the UI end with the service
                proc.terminate()
            for proc, _ in servers.values():
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()

    app = FastAPI(
        title="Mariana jobs",
        description="Submit, watch and manage Mariana training jobs. Mutating requests need "
        "`Authorization: Bearer TOKEN` when the service was started with --token-file.",
        lifespan=lifespan,
    )
    app.state.db, app.state.scheduler, app.state.home = db, sched, home
    app.add_middleware(BodyLimit)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if token:
            mutating = request.method not in ("GET", "HEAD", "OPTIONS")
            remote = request.client.host if request.client else ""
            if mutating or (remote not in LOOPBACK and request.url.path.startswith("/api/")):
                given = request.headers.get("authorization", "")
                if not given.startswith("Bearer ") or not hmac.compare_digest(given[7:].strip(), token):
                    return JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        # FastAPI's default answer echoes each wrong value back ("input"): a big body would come back whole
        errors = [{k: v for k, v in err.items() if k in ("type", "loc", "msg")} for err in e.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(MarianaError)
    async def bad_input(request: Request, e: MarianaError):
        return JSONResponse({"detail": str(e)}, status_code=400)

    def get_job(s, job_id: int) -> Job:
        job = s.get(Job, job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id}")
        return job

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": sched.last_error is None, "slots": sched.slots, "error": sched.last_error,
                "home": str(home), "db": db.engine.url.render_as_string(hide_password=True)}  # fmt: skip

    @app.post("/api/jobs", status_code=201)
    def submit(req: SubmitRequest) -> dict:
        return sched.submit(req.argv, req.priority, req.name, req.cwd, resources=req.resources).to_dict()

    @app.get("/api/jobs")
    def list_jobs(state: str | None = None, limit: int = Query(1000, ge=1, le=100000)) -> dict:
        with db.read() as s:
            q = select(Job).order_by(Job.id.desc()).limit(limit)
            if state:
                q = q.where(Job.state == state)
            now = time.time()
            return {"jobs": [view(j, now) for j in s.scalars(q)]}

    @app.get("/api/jobs/{job_id}")
    def show(job_id: int) -> dict:
        with db.read() as s:
            job = get_job(s, job_id)
            out = view(job)
            out["counters"] = job.counters
        model = Path(job.run_dir) / "model.safetensors"
        if not out.get("export") and model.is_file():  # a running job's best model so far (early stopping)
            out["export"] = str(model)
        with servers_lock:
            proc_url = servers.get(job_id)
        out["served"] = proc_url[1] if proc_url and proc_url[0].poll() is None else None
        cfg = Path(job.run_dir) / "config.toml"
        try:
            out["config"] = read_config_values(cfg) if cfg.is_file() else None  # flat, as flags name it
        except MarianaError:
            out["config"] = None
        return out

    @app.get("/api/jobs/{job_id}/metrics")
    def metrics(job_id: int, after: int = 0, limit: int = Query(100000, ge=1)) -> dict:
        with db.read() as s:
            get_job(s, job_id)
            rows = s.scalars(
                select(MetricRecord)
                .where(MetricRecord.job_id == job_id, MetricRecord.seq > after)
                .order_by(MetricRecord.seq)
                .limit(limit)
            ).all()
        records = [{**r.data, "seq": r.seq, "time": r.time, "step": r.step} for r in rows]
        return {"records": records, "next": rows[-1].seq if rows else after}

    @app.get("/api/jobs/{job_id}/counters")
    def counters(job_id: int, after: int = 0, limit: int = Query(5000, ge=1)) -> dict:
        with db.read() as s:
            job = get_job(s, job_id)
            rows = s.scalars(
                select(CounterRecord)
                .where(CounterRecord.job_id == job_id, CounterRecord.seq > after)
                .order_by(CounterRecord.seq.desc())
                .limit(limit)
            ).all()
        history = [{**r.data, "seq": r.seq, "time": r.time, "source": r.source} for r in reversed(rows)]
        return {"counters": job.counters or {}, "history": history, "next": rows[0].seq if rows else after}

    @app.get("/api/jobs/{job_id}/events")
    def events(job_id: int) -> dict:
        with db.read() as s:
            get_job(s, job_id)
            rows = s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id))
            return {"events": [{"time": e.time, "state": e.state, "message": e.message} for e in rows]}

    @app.get("/api/jobs/{job_id}/logs")
    def logs(job_id: int, tail: int = Query(200, ge=0, le=100000), offset: int | None = None) -> dict:
        """The job's ``RUN/job.log``: its last ``tail`` lines, or everything from byte ``offset``
        (``next`` is the offset to ask for next, for ``logs -f``)."""
        with db.read() as s:
            job = get_job(s, job_id)
        path = Path(job.run_dir) / "job.log"
        start = job.log_offset or 0
        if not path.is_file():
            return {"text": "", "next": offset or start}
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if offset is not None:
                f.seek(max(offset, start))
                data = f.read(1 << 20)
                return {"text": data.decode("utf-8", "replace"), "next": max(offset, start) + len(data)}
            f.seek(max(start, size - (1 << 20)))
            text = f.read().decode("utf-8", "replace")
        lines = text.splitlines(keepends=True)
        return {"text": "".join(lines[-tail:]) if tail else "", "next": size}

    @app.get("/api/jobs/{job_id}/files/{path:path}")
    def files(job_id: int, path: str):
        with db.read() as s:
            job = get_job(s, job_id)
        return FileResponse(_confined(job.run_dir, path))

    @app.post("/api/jobs/{job_id}/cancel")
    def cancel(job_id: int, body: CancelRequest | None = None) -> dict:
        try:
            return view(sched.cancel(job_id, body.reason if body else None))
        except KeyError:
            raise HTTPException(404, f"no job {job_id}") from None

    @app.post("/api/jobs/{job_id}/retry", status_code=201)
    def retry(job_id: int) -> dict:
        try:
            return sched.retry(job_id).to_dict()
        except KeyError:
            raise HTTPException(404, f"no job {job_id}") from None

    @app.post("/api/jobs/{job_id}/serve")
    def serve(job_id: int, body: dict | None = Body(None)) -> dict:
        """Start ``mariana serve --<app> RUN`` for the job's exported model on a free loopback port."""
        with db.read() as s:
            job = get_job(s, job_id)
        from mariana.platform.core.registry import find_app, serving_apps

        spec = find_app(job.app)
        if spec is None or not spec.servable:
            served = ", ".join(s.name for s in serving_apps())
            raise HTTPException(400, f"{job.app} models cannot be served (`mariana serve` serves {served})")
        flag = f"--{spec.name}"
        if not (Path(job.run_dir) / "model.safetensors").is_file():
            raise HTTPException(400, f"job {job_id} has no exported model (RUN/model.safetensors) yet")
        with servers_lock:
            if job_id in servers and servers[job_id][0].poll() is None:
                return {"url": servers[job_id][1], "pid": servers[job_id][0].pid}
            port = _free_port()
            with open(Path(job.run_dir) / "serve.log", "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "mariana.platform.cli", "serve", flag, job.run_dir,
                     "--host", "127.0.0.1", "--port", str(port)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            servers[job_id] = (proc, url)
        return {"url": url, "pid": proc.pid}

    @app.post("/api/jobs/{job_id}/serve/stop")
    def serve_stop(job_id: int) -> dict:
        """Stop the model server started by ``/serve`` (SIGTERM, SIGKILL after 10 s) and reap it."""
        with servers_lock:
            entry = servers.pop(job_id, None)
        if entry is None:
            raise HTTPException(404, f"job {job_id} has no model server running")
        proc, url = entry
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return {"stopped": url, "exit_code": proc.returncode}

    try:
        from .ui import mount_ui
    except ImportError:
        mount_ui = None
    if mount_ui is not None:
        mount_ui(app)
    return app
