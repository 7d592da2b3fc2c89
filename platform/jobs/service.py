"""The job service: ``create_app(home, db_url, slots, token)`` -> a FastAPI app with the REST API (``/docs``
documents it; the routers are in ``routes.py``, ``studies.py`` and ``ui.py`` and find the database,
scheduler and model servers in ``app.state``), the web UI and the scheduler thread (started and stopped
with the app's lifespan). Request bodies are capped at ``MAX_BODY`` bytes (413, body unread), a job's argv
at ``MAX_ARGV``.

Auth: with a token configured, every mutating request (anything but GET/HEAD/OPTIONS) needs
``Authorization: Bearer TOKEN`` (401 otherwise), and so do ``/api`` reads from other hosts than loopback.
"""

from __future__ import annotations

import hmac
import os
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.listen import LOOPBACK

from . import routes
from .db import Database, default_url
from .modelservers import ModelServers
from .scheduler import Scheduler
from .ui import mount_ui

MAX_BODY = 1 << 20  # bytes of one request body (a job's argv and options; files are never uploaded)


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


def _add_auth(app: FastAPI, token: str | None) -> None:
    """With a ``token``, every mutating request and every ``/api`` read from off loopback needs
    ``Authorization: Bearer TOKEN`` (401 otherwise)."""

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


def _add_error_handlers(app: FastAPI) -> None:
    """422 without the echoed input values; `MarianaError` (a refused submit) -> 400 with its line."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        # FastAPI's default answer echoes each wrong value back ("input"): a big body would come back whole
        errors = [{k: v for k, v in err.items() if k in ("type", "loc", "msg")} for err in e.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(MarianaError)
    async def bad_input(request: Request, e: MarianaError):
        return JSONResponse({"detail": str(e)}, status_code=400)


def create_app(home: str | Path, db_url: str | None = None, slots: int | None = None, token: str | None = None,
               grace_s: float = 10.0, executor=None, build_parser=None, check=None) -> FastAPI:  # fmt: skip
    """The service for jobs under ``home`` (run directories in ``home/runs``), database ``db_url``
    (default SQLite ``home/jobs.db``), ``slots`` (default the core count), optional bearer ``token``;
    ``build_parser()`` -> the ``mariana`` argparse tree submitted argvs are checked against (the CLI's);
    ``check(argv, cwd, tasks)``: the command's checks before it trains (`cli.main.check_command`)."""
    home = Path(home).expanduser().resolve()
    (home / "runs").mkdir(parents=True, exist_ok=True)
    db = Database(db_url or default_url(home))
    slots = slots or getattr(executor, "default_slots", None) or os.cpu_count() or 1
    # executor None: LocalExecutor
    sched = Scheduler(db, home, slots, executor=executor, grace_s=grace_s, build_parser=build_parser,
                      check=check)  # fmt: skip
    servers = ModelServers()

    @asynccontextmanager
    async def lifespan(app):
        sched.start()
        try:
            yield
        finally:
            sched.stop()
            servers.close()  # model servers started from the UI end with the service

    app = FastAPI(
        title="Mariana jobs",
        description="Submit, watch and manage Mariana training jobs. Mutating requests need "
        "`Authorization: Bearer TOKEN` when the service was started with --token-file.",
        lifespan=lifespan,
    )
    app.state.db, app.state.scheduler, app.state.home, app.state.servers = db, sched, home, servers
    app.add_middleware(BodyLimit)
    _add_auth(app, token)
    _add_error_handlers(app)
    for router in (routes.health, routes.jobs, routes.runs, routes.models):
        app.include_router(router)
    mount_ui(app)
    return app
