"""The job service's REST API, one `APIRouter` per concern (``service.create_app`` includes them):

- `jobs`:   ``POST /api/jobs``, ``GET /api/jobs``, ``GET /api/jobs/{id}``, ``POST .../cancel|retry``
- `runs`:   what a job's run directory holds: ``GET /api/jobs/{id}/metrics|counters|events|logs|files/...``
- `models`: ``POST /api/jobs/{id}/serve`` and ``.../serve/stop`` (a model server for the job's export)
- `health`: ``GET /healthz``

Routes find the service's `Database`, `Scheduler`, home folder and `ModelServers` in ``app.state``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Body, Depends, HTTPException, Query, Request
from fastapi.responses import FileResponse
from mariana.platform.core.config import read_config_values
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.registry import find_app, serving_apps
from pydantic import BaseModel, Field, field_validator
from sqlalchemy import select
from sqlalchemy.orm import Session

from .db import CounterRecord, Database, Job, JobEvent, MetricRecord
from .logstore import job_files
from .modelservers import ModelServers
from .scheduler import PRUNED, Scheduler

MAX_ARGV = 64 << 10  # bytes of a job's argv, all arguments together


def _db(request: Request) -> Database:
    return request.app.state.db


def _scheduler(request: Request) -> Scheduler:
    return request.app.state.scheduler


def _servers(request: Request) -> ModelServers:
    return request.app.state.servers


DB = Annotated[Database, Depends(_db)]
Sched = Annotated[Scheduler, Depends(_scheduler)]
Servers = Annotated[ModelServers, Depends(_servers)]

jobs = APIRouter()
runs = APIRouter()
models = APIRouter()
health = APIRouter()


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


def get_job(s: Session, job_id: int) -> Job:
    """The job ``job_id`` of session ``s``, or 404."""
    job = s.get(Job, job_id)
    if job is None:
        raise HTTPException(404, f"no job {job_id}")
    return job


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


@health.get("/healthz")
def healthz(request: Request, db: DB, sched: Sched) -> dict:
    return {"ok": sched.last_error is None, "slots": sched.slots, "error": sched.last_error,
            "home": str(request.app.state.home), "db": db.engine.url.render_as_string(hide_password=True)}  # fmt: skip


@jobs.post("/api/jobs", status_code=201)
def submit(req: SubmitRequest, sched: Sched) -> dict:
    return sched.submit(req.argv, req.priority, req.name, req.cwd, resources=req.resources).to_dict()


@jobs.get("/api/jobs")
def list_jobs(db: DB, state: str | None = None, limit: int = Query(1000, ge=1, le=100000)) -> dict:
    with db.read() as s:
        q = select(Job).order_by(Job.id.desc()).limit(limit)
        if state:
            q = q.where(Job.state == state)
        now = time.time()
        return {"jobs": [view(j, now) for j in s.scalars(q)]}


@jobs.get("/api/jobs/{job_id}")
def show(job_id: int, db: DB, servers: Servers) -> dict:
    """The job object with its counters, its export (a running job's best model so far), the URL of its
    model server (None when none runs), its run's ``config.toml`` and ``tracking.json``."""
    with db.read() as s:
        job = get_job(s, job_id)
        out = view(job)
        out["counters"] = job.counters
    model = Path(job.run_dir) / "model.safetensors"
    if not out.get("export") and model.is_file():  # a running job's best model so far (early stopping)
        out["export"] = str(model)
    out["served"] = servers.url(job_id)
    cfg, tracking = Path(job.run_dir) / "config.toml", Path(job.run_dir) / "tracking.json"  # MLflow page
    out["tracking"] = json.loads(tracking.read_text()) if tracking.is_file() else None
    try:
        out["config"] = read_config_values(cfg) if cfg.is_file() else None  # flat, as flags name it
    except MarianaError:
        out["config"] = None
    return out


@jobs.post("/api/jobs/{job_id}/cancel")
def cancel(job_id: int, sched: Sched, body: CancelRequest | None = None) -> dict:
    try:
        return view(sched.cancel(job_id, body.reason if body else None))
    except KeyError:
        raise HTTPException(404, f"no job {job_id}") from None


@jobs.post("/api/jobs/{job_id}/retry", status_code=201)
def retry(job_id: int, sched: Sched) -> dict:
    try:
        return sched.retry(job_id).to_dict()
    except KeyError:
        raise HTTPException(404, f"no job {job_id}") from None


@runs.get("/api/jobs/{job_id}/metrics")
def metrics(job_id: int, db: DB, after: int = 0, limit: int = Query(100000, ge=1)) -> dict:
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


@runs.get("/api/jobs/{job_id}/counters")
def counters(job_id: int, db: DB, after: int = 0, limit: int = Query(5000, ge=1)) -> dict:
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


@runs.get("/api/jobs/{job_id}/events")
def events(job_id: int, db: DB) -> dict:
    with db.read() as s:
        get_job(s, job_id)
        rows = s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id))
        return {"events": [{"time": e.time, "state": e.state, "message": e.message} for e in rows]}


@runs.get("/api/jobs/{job_id}/logs")
def logs(
    request: Request, job_id: int, db: DB, tail: int = Query(200, ge=0, le=100000), offset: int | None = None
) -> dict:
    """The job's ``RUN/job.log``: its last ``tail`` lines, or everything from byte ``offset``
    (``next`` is the offset to ask for next, for ``logs -f``)."""
    with db.read() as s:
        job = get_job(s, job_id)
    path = job_files(request.app.state.home, job) / "job.log"
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


@runs.get("/api/jobs/{job_id}/files/{path:path}")
def files(job_id: int, path: str, db: DB):
    with db.read() as s:
        job = get_job(s, job_id)
    return FileResponse(_confined(job.run_dir, path))


@models.post("/api/jobs/{job_id}/serve")
def serve(job_id: int, db: DB, servers: Servers, body: dict | None = Body(None)) -> dict:
    """Start ``mariana serve --<app> RUN`` for the job's exported model on a free loopback port."""
    with db.read() as s:
        job = get_job(s, job_id)
    spec = find_app(job.app)
    if spec is None or not spec.servable:
        served = ", ".join(s.name for s in serving_apps())
        raise HTTPException(400, f"{job.app} models cannot be served (`mariana serve` serves {served})")
    if not (Path(job.run_dir) / "model.safetensors").is_file():
        raise HTTPException(400, f"job {job_id} has no exported model (RUN/model.safetensors) yet")
    return servers.start(job_id, f"--{spec.name}", job.run_dir)


@models.post("/api/jobs/{job_id}/serve/stop")
def serve_stop(job_id: int, servers: Servers) -> dict:
    """Stop the model server started by ``/serve`` (SIGTERM, SIGKILL after 10 s) and reap it."""
    stopped = servers.stop(job_id)
    if stopped is None:
        raise HTTPException(404, f"job {job_id} has no model server running")
    return stopped
