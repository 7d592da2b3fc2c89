"""The FastAPI application of ``mariana serve``: every servable app's REST routes plus the generic ones.

``create_app(ServeConfig(models={APP: RUN, ...}))`` loads the models (once, before serving) and returns the
app. Each app's routes come from its spec (`mariana.platform.core.registry.AppSpec.routes`, e.g.
``POST /v1/<app>/...``), mounted as one router per app; an app's routes exist whether or not its model
was given (a stable API schema) and answer 404 naming the missing ``--<app>`` flag when it was not. The
generic routes are here (health, metrics, reload, docs, `open_inference`'s ``/v2/...``); what they answer,
the reload roots and the token: serving/README.md. Every client error is a 4xx with a JSON body ``{"error":
"<what is wrong>", ...}``; request bodies are size-limited (per route, as declared) before they are read.
"""

import asyncio
import hmac
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.listen import LOOPBACK
from mariana.platform.core.registry import serving_apps
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import open_inference
from .batcher import MicroBatcher, Overloaded
from .context import AppContext, Registry, ServeConfig, error
from .models import ModelSlot, serving_spec, watch

log = logging.getLogger("mariana.serving")

SMALL_BODY = 64 * 1024  # routes without a payload (health, metrics, admin)
GENERIC_PATHS = ("/healthz", "/health", "/metrics", "/v1/admin/reload")


def set_threads(cfg: ServeConfig) -> int:
    """Torch threads for this process: the machine's cores shared among the uvicorn workers; one inter-op
    thread (each model call is one graph; requests are parallelised by batching, not by threads)."""
    import torch

    n = cfg.threads or max(1, (os.cpu_count() or 1) // max(1, cfg.workers))
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process (tests create several apps)
        pass
    return n


# ----------------------------------------------------------------------------------------------- errors
def _loc(loc) -> str:
    return ".".join(str(x) for x in loc) or "body"


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # Built by hand: the default handler echoes the input back, which may not even be JSON-encodable.
    errors = []
    for e in exc.errors()[:20]:
        msg = str(e.get("msg", "invalid"))
        ctx = e.get("ctx") or {}
        if e.get("type") == "json_invalid" and ctx.get("error"):  # say where the JSON is broken
            msg = f"{msg}: {ctx['error']}"
        errors.append({"loc": _loc(e.get("loc", ())), "msg": msg})
    first = errors[0] if errors else {"loc": "body", "msg": "invalid request"}
    return error(422, f"{first['loc']}: {first['msg']}", errors=errors)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    detail = str(exc.detail)
    if exc.status_code == 400 and detail == "There was an error parsing the body":
        # FastAPI's words when the body is not decodable at all (bad UTF-8, JSON nested too deeply).
        detail = "body: could not be parsed (expected UTF-8 JSON, nested at most a few hundred levels)"
    elif exc.status_code == 405:
        detail = f"method {request.method} not allowed on {request.url.path}"
    elif exc.status_code == 404:
        detail = f"no such endpoint: {request.url.path} (see /docs)"
    return JSONResponse({"error": detail}, status_code=exc.status_code, headers=exc.headers)


async def _mariana_error(request: Request, exc: MarianaError) -> JSONResponse:
    if isinstance(exc, Overloaded):  # 429, not 503: the service is healthy, this client should back off
        return JSONResponse({"error": str(exc)}, status_code=429, headers={"Retry-After": "1"})
    return error(getattr(exc, "status", 400), str(exc))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error on %s", request.url.path, exc_info=exc)
    return error(500, f"internal error ({type(exc).__name__})")


# ------------------------------------------------------------------------------------------ middleware
class BodyLimitMiddleware:
    """Reads the whole request body up to the route's limit before the app sees it: larger bodies (by
    Content-Length or by what actually arrives) are answered 413 without being buffered. A route that
    takes JSON refuses other content types (415) before reading anything."""

    def __init__(self, app, limits: dict[str, tuple[int, bool]], default: int = SMALL_BODY):
        self.app, self.limits, self.default = app, limits, default

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, json_only = self.limits.get(scope["path"], (self.default, False))
        if json_only and scope.get("method") == "POST":
            ctype = next((v for k, v in scope.get("headers", ()) if k == b"content-type"), b"")
            if ctype.split(b";")[0].strip().lower() != b"application/json":
                shown = ctype.decode("latin-1")[:80] or "none"
                return await self._reply(send, 415, f"Content-Type must be application/json (got {shown})")
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                if not v.isdigit():
                    return await self._reply(send, 400, "invalid Content-Length header")
                if int(v) > limit:
                    return await self._reply(send, 413, f"request body too large ({int(v)} > {limit} bytes)")
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            body = msg.get("body", b"")
            size += len(body)
            if size > limit:
                return await self._reply(send, 413, f"request body too large (over {limit} bytes)")
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # waits for the disconnect, as Starlette expects

        return await self.app(scope, replay, send)

    @staticmethod
    async def _reply(send, status: int, message: str):
        body = json.dumps({"error": message}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class MetricsMiddleware:
    """Counts every response by route template and status, and times it; announces requests to the
    micro-batcher of their path (``batchers``) as soon as they arrive."""

    def __init__(self, app, metrics: Registry, batchers: dict[str, MicroBatcher], known_paths: frozenset):
        self.app, self.metrics, self.batchers, self.known_paths = app, metrics, batchers, known_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500
        batcher = self.batchers.get(scope["path"])
        if batcher is not None:
            batcher.expect(scope)  # the micro-batcher waits for requests already in the server

        async def send_wrapper(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if batcher is not None:
                batcher.arrived(scope)
            route = getattr(scope.get("route"), "path", None)
            if route is None:  # answered before routing (413) or no such route; keep label cardinality low
                route = scope["path"] if scope["path"] in self.known_paths else "unmatched"
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------- service
class Service:
    """The models of one server process (a `ModelSlot` and an inference thread per served app) and one
    `AppContext` per servable app, whose routes it mounts."""

    def __init__(self, cfg: ServeConfig, metrics: Registry):
        self.cfg, self.metrics = cfg, metrics
        for app in cfg.models:
            serving_spec(app)  # an unknown or unservable app fails before any model is loaded
        self.slots: dict[str, ModelSlot] = {}
        for app, run_dir in cfg.models.items():
            if run_dir:
                self.slots[app] = ModelSlot(
                    app,
                    run_dir,
                    on_change=lambda ld: metrics.serving(ld.app, ld.version, ld.run_dir),
                    on_reload=lambda result, app=app: metrics.reloads.labels(app, result).inc(),
                    runtime=cfg.runtime,
                )
        # One inference thread per model: calls on one model are serialised, its ops use torch's threads.
        self.executors = {app: ThreadPoolExecutor(1, thread_name_prefix=f"infer-{app}") for app in self.slots}
        apps = [spec.name for spec in serving_apps()]
        self.contexts = {
            a: AppContext(a, cfg, metrics, self.slots.get(a), self.executors.get(a)) for a in apps
        }
        self._watch_task: asyncio.Task | None = None

    def routers(self) -> list[APIRouter]:
        """Each servable app's router (from its spec), built on its context."""
        return [serving_spec(app).router(ctx) for app, ctx in self.contexts.items()]

    @property
    def batchers(self) -> dict[str, MicroBatcher]:
        return {path: b for ctx in self.contexts.values() for path, b in ctx.batchers.items()}

    @property
    def limits(self) -> dict[str, tuple[int, bool]]:
        return {path: lim for ctx in self.contexts.values() for path, lim in ctx.limits.items()}

    async def start(self) -> None:
        for b in self.batchers.values():
            b.start()
        if self.cfg.watch and self.slots:
            self._watch_task = asyncio.get_running_loop().create_task(
                watch(self.slots, self.cfg.watch_interval_s), name="model-watch"
            )

    async def stop(self) -> None:
        if self._watch_task:
            self._watch_task.cancel()
        for b in self.batchers.values():
            await b.stop()
        for ex in self.executors.values():
            ex.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------------------- generic routes
class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    app: str | None = Field(None, description="the app whose model to reload; default: every served app")
    run_dir: str | None = Field(
        None, description="switch to this run directory; default: reload the current one"
    )


def generic_router(svc: Service) -> APIRouter:
    """``/healthz``, ``/metrics`` and ``/v1/admin/reload``: the same for every app."""
    r = APIRouter()

    @r.get("/healthz", summary="liveness + the served model versions")
    @r.get("/health", summary="liveness + the served model versions (as /healthz)")
    async def healthz() -> dict:
        return {"status": "ok", "models": {a: s.current.describe() for a, s in svc.slots.items()}}

    @r.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics (text format 0.0.4)")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @r.post("/v1/admin/reload", summary="switch to a new model version atomically (old one kept on failure)")
    async def reload(req: ReloadRequest | None = None) -> dict:
        req = req or ReloadRequest()
        if req.app is not None and req.app not in svc.slots:
            served = ", ".join(svc.slots) or "none"
            return error(404, f"app {req.app!r} is not served here (served: {served})")
        targets = [req.app] if req.app else list(svc.slots)
        if req.run_dir is not None and len(targets) != 1:
            return error(422, "run_dir needs app (which model to switch)")
        if not targets:
            return error(404, "no model is served")
        if req.run_dir is not None:
            roots = svc.cfg.roots()
            if not any(Path(req.run_dir).resolve().is_relative_to(r) for r in roots):
                where = ", ".join(map(str, roots))
                return error(
                    403, f"run_dir {req.run_dir} is outside the reload roots ({where}); see --reload-root"
                )
        done = {}
        for a in targets:
            try:
                old, new = await svc.slots[a].reload(req.run_dir)
            except MarianaError as e:
                return error(
                    422,
                    f"{a}: new model refused, still serving version {svc.slots[a].current.version}: {e}",
                    reloaded=done,
                    serving={k: s.current.describe() for k, s in svc.slots.items()},
                )
            done[a] = {"previous": old.version, **new.describe()}
        return {"reloaded": done}

    return r


# ------------------------------------------------------------------------------------------------ app
def create_app(cfg: ServeConfig | None = None) -> FastAPI:
    """Load the configured models and build the FastAPI app (raises MarianaError if a model is bad)."""
    cfg = cfg or ServeConfig()
    set_threads(cfg)
    metrics = Registry()
    svc = Service(cfg, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await svc.start()
        try:
            yield
        finally:
            await svc.stop()

    app = FastAPI(
        title="Mariana serving",
        version="1.0",
        description="REST inference for the trained models of the served apps.",
        lifespan=lifespan,
    )
    app.state.service, app.state.metrics = svc, metrics
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(MarianaError, _mariana_error)
    app.add_exception_handler(Exception, _internal_error)

    app.include_router(generic_router(svc))
    for router in svc.routers():
        app.include_router(router)
    app.include_router(open_inference.router(svc.contexts))
    known = frozenset(GENERIC_PATHS) | {getattr(r, "path", "") for r in app.routes}
    if cfg.token:
        token = cfg.token

        @app.middleware("http")
        async def auth(request: Request, call_next):
            remote = request.client.host if request.client else ""
            if request.url.path.startswith("/v1/admin/") or remote not in LOOPBACK:
                given = request.headers.get("authorization", "")
                if not given.startswith("Bearer ") or not hmac.compare_digest(given[7:].strip(), token):
                    return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
            return await call_next(request)

    app.add_middleware(BodyLimitMiddleware, limits=svc.limits)
    # outermost: counts the 413s and 415s too
    app.add_middleware(MetricsMiddleware, metrics=metrics, batchers=svc.batchers, known_paths=known)
    return app


def app_from_env() -> FastAPI:
    """Factory for ``uvicorn --factory`` / ``--workers N``: the config comes in ``MARIANA_SERVE_CONFIG``."""
    return create_app(ServeConfig.from_json(os.environ["MARIANA_SERVE_CONFIG"]))
