"""The FastAPI application: click prediction, transcription and image classification over REST.

``create_app(ServeConfig(...))`` loads the models (once, before serving), and returns the app:

- ``POST /v1/pctr/predict``  ``{"instances": [LINE | {field: value}, ...]}`` ->
  ``{"probabilities": [p | null, ...], "errors": [{"index": i, "error": msg}], "model_version": v}``
- ``POST /v1/asr/transcribe``  multipart ``file`` = WAV -> ``{"transcript": str, "model_version": v}``
- ``POST /v1/vision/classify`` multipart ``file`` = JPEG/PNG -> ``{"labels": [{"label", "probability"}], ...}``
- ``GET /healthz``, ``GET /metrics`` (Prometheus text), ``POST /v1/admin/reload``, ``/docs``.

An app's routes exist only when its model was given. Every client error is a 4xx with a JSON body
``{"error": "<what is wrong>", ...}``; request bodies are size-limited before they are read.
"""

import asyncio
import json
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Annotated, Any

from fastapi import FastAPI, File, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from mariana.platform.core.errors import MarianaError
from pydantic import BaseModel, ConfigDict, Field, StrictStr, create_model
from starlette.exceptions import HTTPException as StarletteHTTPException

from .batcher import MicroBatcher, Overloaded
from .metrics import Registry
from .models import ModelSlot, watch

log = logging.getLogger("mariana.serving")

SMALL_BODY = 64 * 1024  # routes without a payload (health, metrics, admin)
KNOWN_PATHS = frozenset(
    [
        "/v1/pctr/predict",
        "/v1/asr/transcribe",
        "/v1/vision/classify",
        "/healthz",
        "/metrics",
        "/v1/admin/reload",
    ]
)


@dataclass
class ServeConfig:
    """Everything ``mariana serve`` passes to the app (also JSON-serialisable for ``--workers N``)."""

    pctr: str | None = None
    asr: str | None = None
    vision: str | None = None
    max_batch: int = 2048  # instances per model call
    max_wait_ms: float = 1.0  # longest a queued request waits for requests already in the server
    max_instances: int = 10_000  # per request
    max_body_bytes: int = 16 * 1024 * 1024  # JSON prediction bodies
    max_upload_bytes: int = 16 * 1024 * 1024  # WAV / image uploads
    max_queue: int = 200_000  # instances waiting before requests are refused with 503
    inline_max: int = 64  # micro-batches up to this size run on the event loop thread (no thread hop)
    threads: int = 0  # torch intra-op threads; 0 = cores / workers
    workers: int = 1
    watch: bool = False
    watch_interval_s: float = 2.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ServeConfig":
        return cls(**json.loads(text))


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
def _err(status: int, message: str, **extra) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


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
    return _err(422, f"{first['loc']}: {first['msg']}", errors=errors)


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
    return _err(400, str(exc))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error on %s", request.url.path, exc_info=exc)
    return _err(500, f"internal error ({type(exc).__name__})")


# ------------------------------------------------------------------------------------------ middleware
class BodyLimitMiddleware:
    """Reads the whole request body up to the route's limit before the app sees it: larger bodies (by
    Content-Length or by what actually arrives) are answered 413 without being buffered."""

    def __init__(self, app, limit_for):
        self.app, self.limit_for = app, limit_for

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope["path"])
        if scope["path"] == "/v1/pctr/predict" and scope.get("method") == "POST":
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
    """Counts every response by route template and status, and times it."""

    def __init__(self, app, metrics: Registry, batcher: MicroBatcher | None = None):
        self.app, self.metrics, self.batcher = app, metrics, batcher

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500
        if self.batcher is not None and scope["path"] == "/v1/pctr/predict":
            self.batcher.expect(scope)  # the micro-batcher waits for requests already in the server

        async def send_wrapper(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if self.batcher is not None:
                self.batcher.arrived(scope)
            route = getattr(scope.get("route"), "path", None)
            if route is None:  # answered before routing (413) or no such route; keep label cardinality low
                route = scope["path"] if scope["path"] in KNOWN_PATHS else "unmatched"
            self.metrics.requests.inc({"route": route, "status": str(status)})
            self.metrics.latency.observe(time.perf_counter() - t0, {"route": route})


# ------------------------------------------------------------------------------------------- schemas
Instance = StrictStr | dict[str, Any]


class PctrResponse(BaseModel):
    probabilities: list[float | None] = Field(description="click probability per instance; null if invalid")
    errors: list[dict[str, Any]] = Field(description='[{"index": i, "error": message}] for invalid instances')
    model_version: str


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    app: str | None = Field(None, description="pctr | asr | vision; default: every served app")
    run_dir: str | None = Field(
        None, description="switch to this run directory; default: reload the current one"
    )


WAV_MAGIC = (b"RIFF", b"RIFX", b"RF64")
IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a")


def _is_wav(data: bytes) -> bool:
    return len(data) >= 12 and data[:4] in WAV_MAGIC and data[8:12] == b"WAVE"


def _is_image(data: bytes) -> bool:
    return any(data.startswith(m) for m in IMAGE_MAGIC)


# ------------------------------------------------------------------------------------------------ app
class Service:
    """The models, their batchers and executors, and the metrics of one server process."""

    def __init__(self, cfg: ServeConfig, metrics: Registry):
        self.cfg, self.metrics = cfg, metrics
        self.slots: dict[str, ModelSlot] = {}
        for app in ("pctr", "asr", "vision"):
            run_dir = getattr(cfg, app)
            if run_dir:
                self.slots[app] = ModelSlot(
                    app,
                    run_dir,
                    on_change=lambda ld: metrics.model_info.set_exclusive(
                        1, {"app": ld.app, "version": ld.version, "run_dir": ld.run_dir}, by="app"
                    ),
                    on_reload=lambda result, app=app: metrics.reloads.inc({"app": app, "result": result}),
                )
        # One inference thread per model: calls on one model are serialised, its ops use torch's threads.
        self.executors = {app: ThreadPoolExecutor(1, thread_name_prefix=f"infer-{app}") for app in self.slots}
        self.batcher: MicroBatcher | None = None
        if "pctr" in self.slots:
            self.batcher = MicroBatcher(
                self._pctr_batch,
                self.executors["pctr"],
                max_batch=cfg.max_batch,
                max_wait_s=cfg.max_wait_ms / 1000.0,
                max_queue=cfg.max_queue,
                inline_max=cfg.inline_max,
                on_batch=self._on_batch,
                on_queue=lambda d: metrics.queue_depth.set(d, {"app": "pctr"}),
            )
            metrics.queue_depth.set(0, {"app": "pctr"})
        self._watch_task: asyncio.Task | None = None

    def _on_batch(self, n: int, seconds: float) -> None:
        self.metrics.batch_size.observe(n, {"app": "pctr"})
        self.metrics.batch_latency.observe(seconds, {"app": "pctr"})

    def _pctr_batch(self, items: list) -> tuple[list, str]:
        """Inference thread: parse + predict a micro-batch of instances (strings and/or dicts) with the
        model current at this moment. Returns one float (probability) or str (error) per item."""
        loaded = self.slots["pctr"].current  # this batch finishes on this version even if a reload lands
        try:
            return self._pctr_score(loaded.obj, items), loaded.version
        except Exception as e:  # noqa: BLE001
            if len(items) == 1:
                log.warning("pctr: instance rejected: %s: %s", type(e).__name__, e)
                return [f"instance could not be scored ({type(e).__name__}: {e})"], loaded.version
        # The predictor raised instead of reporting per-instance errors: score one by one so one bad
        # instance cannot fail the other requests of its micro-batch (slow path, only after a failure).
        log.warning("pctr: batch of %d raised; scoring instances one by one", len(items))
        out = []
        for x in items:
            try:
                out += self._pctr_score(loaded.obj, [x])
            except Exception as e:  # noqa: BLE001
                out.append(f"instance could not be scored ({type(e).__name__}: {e})")
        return out, loaded.version

    def _pctr_score(self, pred, items: list) -> list:
        import torch

        out: list = [None] * len(items)
        lines_idx = [i for i, x in enumerate(items) if isinstance(x, str)]
        json_idx = [i for i, x in enumerate(items) if not isinstance(x, str)]
        with torch.inference_mode():
            if lines_idx:
                lines = items if len(lines_idx) == len(items) else [items[i] for i in lines_idx]
                probs, errors = pred.predict_lines(lines)
                self._scatter(out, lines_idx, probs, errors)
            if json_idx:
                if not callable(getattr(pred, "parse_json", None)):
                    for i in json_idx:
                        out[i] = "this model accepts only text records (its training format)"
                else:
                    batch, errors = pred.parse_json([items[i] for i in json_idx])
                    valid = [j for j in range(len(json_idx)) if j not in errors]
                    probs: list = [None] * len(json_idx)
                    if valid:
                        p = pred.predict(batch)
                        for j, v in zip(valid, p.tolist() if hasattr(p, "tolist") else list(p)):
                            probs[j] = v
                    self._scatter(out, json_idx, probs, errors)
        return out

    @staticmethod
    def _scatter(out: list, idx: list[int], probs, errors: dict) -> None:
        for j, i in enumerate(idx):
            if j in errors:
                out[i] = str(errors[j])
            elif probs[j] is None:
                out[i] = "instance could not be scored"
            elif not math.isfinite(p := float(probs[j])):  # NaN/inf feature values: not valid JSON either
                out[i] = f"instance has non-finite feature values (probability {p})"
            else:
                out[i] = p

    async def start(self) -> None:
        if self.batcher:
            self.batcher.start()
        if self.cfg.watch and self.slots:
            self._watch_task = asyncio.get_running_loop().create_task(
                watch(self.slots, self.cfg.watch_interval_s), name="model-watch"
            )

    async def stop(self) -> None:
        if self._watch_task:
            self._watch_task.cancel()
        if self.batcher:
            await self.batcher.stop()
        for ex in self.executors.values():
            ex.shutdown(wait=False, cancel_futures=True)

    async def run(self, app: str, fn, *args):
        """Run a (non-batched) model call on the app's inference thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executors[app], fn, *args)


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
        description="Click prediction, speech transcription and image classification.",
        lifespan=lifespan,
    )
    app.state.service, app.state.metrics = svc, metrics
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(MarianaError, _mariana_error)
    app.add_exception_handler(Exception, _internal_error)

    upload_paths = {"/v1/asr/transcribe", "/v1/vision/classify"}

    def limit_for(path: str) -> int:
        if path == "/v1/pctr/predict":
            return cfg.max_body_bytes
        if path in upload_paths:
            return cfg.max_upload_bytes
        return SMALL_BODY

    app.add_middleware(BodyLimitMiddleware, limit_for=limit_for)
    app.add_middleware(MetricsMiddleware, metrics=metrics, batcher=svc.batcher)  # outermost: counts 413s too

    @app.get("/healthz", summary="liveness + the served model versions")
    async def healthz() -> dict:
        return {"status": "ok", "models": {a: s.current.describe() for a, s in svc.slots.items()}}

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics (text format 0.0.4)")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post(
        "/v1/admin/reload", summary="switch to a new model version atomically (old one kept on failure)"
    )
    async def reload(req: ReloadRequest | None = None) -> dict:
        req = req or ReloadRequest()
        if req.app is not None and req.app not in svc.slots:
            served = ", ".join(svc.slots) or "none"
            return _err(404, f"app {req.app!r} is not served here (served: {served})")
        targets = [req.app] if req.app else list(svc.slots)
        if req.run_dir is not None and len(targets) != 1:
            return _err(422, "run_dir needs app (which model to switch)")
        if not targets:
            return _err(404, "no model is served")
        done = {}
        for a in targets:
            try:
                old, new = await svc.slots[a].reload(req.run_dir)
            except MarianaError as e:
                return _err(
                    422,
                    f"{a}: new model refused, still serving version {svc.slots[a].current.version}: {e}",
                    reloaded=done,
                    serving={k: s.current.describe() for k, s in svc.slots.items()},
                )
            done[a] = {"previous": old.version, **new.describe()}
        return {"reloaded": done}

    if "pctr" in svc.slots:
        req_model = create_model(
            "PctrRequest",
            __config__=ConfigDict(extra="forbid"),
            instances=(
                Annotated[
                    list[Instance],
                    Field(
                        min_length=1,
                        max_length=cfg.max_instances,
                        description="records in the model's training format without the label (a Criteo "
                        "TSV line or a libFM 'id:value ...' line), or structured {field: value} objects",
                    ),
                ],
                ...,
            ),
        )

        @app.post(
            "/v1/pctr/predict",
            response_model=PctrResponse,
            summary="click probabilities for a batch of records",
            responses={422: {"description": "invalid request, or no valid instance"}},
        )
        async def pctr_predict(body: req_model, request: Request) -> Response:  # type: ignore[valid-type]
            instances = body.instances
            svc.batcher.arrived(request.scope)
            results, version = await svc.batcher.submit(instances)
            probs, errors = [], []
            for i, r in enumerate(results):
                if isinstance(r, float):
                    probs.append(r)
                else:
                    probs.append(None)
                    errors.append({"index": i, "error": r})
            n_err = len(errors)
            metrics.instances.inc({"app": "pctr", "result": "ok"}, len(results) - n_err)
            if n_err:
                metrics.instances.inc({"app": "pctr", "result": "error"}, n_err)
            payload = {"probabilities": probs, "errors": errors, "model_version": version}
            if n_err == len(results):
                payload["error"] = f"no valid instance: instance 0: {errors[0]['error']}"
                return Response(json.dumps(payload), status_code=422, media_type="application/json")
            # Serialised directly: jsonable_encoder on 10k floats costs more than the model.
            return Response(json.dumps(payload), media_type="application/json")

    # The ASR and vision routes always exist (a stable API schema); their app modules are imported only
    # when a model is given, so a pCTR-only server needs nothing of them. Without a model they answer 404.
    def _not_served(app_name: str) -> JSONResponse:
        return _err(404, f"{app_name} is not served here (start the server with --{app_name} RUN)")

    @app.post(
        "/v1/asr/transcribe",
        summary="transcribe a WAV upload (multipart field 'file')",
        responses={404: {"description": "no ASR model served"}, 415: {"description": "not a WAV file"}},
    )
    async def asr_transcribe(file: UploadFile = File(..., description="WAV audio")) -> dict:
        if "asr" not in svc.slots:
            return _not_served("asr")
        data = await file.read()
        if not data:
            return _err(422, "file: empty upload")
        if not _is_wav(data):
            return _err(415, "file: not a WAV file (expected a RIFF/WAVE header)")
        loaded = svc.slots["asr"].current
        try:
            text = await svc.run("asr", loaded.obj.transcribe_wav_bytes, data)
        except MarianaError as e:
            return _err(422, f"file: {e}")
        except Exception as e:  # noqa: BLE001  -- undecodable audio must not become a 500
            # The detail goes to the server log; the client gets a plain message, not an internal one.
            log.warning("asr: upload rejected: %s: %s", type(e).__name__, e)
            return _err(422, "file: audio could not be decoded or transcribed (expected a WAV file)")
        return {"transcript": text, "model_version": loaded.version}

    @app.post(
        "/v1/vision/classify",
        summary="top-k labels for a JPEG/PNG upload (multipart field 'file')",
        responses={404: {"description": "no vision model served"}, 415: {"description": "not an image"}},
    )
    async def vision_classify(
        file: UploadFile = File(..., description="JPEG or PNG image"),
        k: int = Query(5, ge=1, le=100, description="how many labels"),
    ) -> dict:
        if "vision" not in svc.slots:
            return _not_served("vision")
        data = await file.read()
        if not data:
            return _err(422, "file: empty upload")
        if not _is_image(data):
            return _err(415, "file: not a JPEG/PNG/GIF image")
        loaded = svc.slots["vision"].current
        try:
            top = await svc.run("vision", loaded.obj.classify_bytes, data, k)
        except MarianaError as e:
            return _err(422, f"file: {e}")
        except Exception as e:  # noqa: BLE001  -- a corrupt image must not become a 500
            log.warning("vision: upload rejected: %s: %s", type(e).__name__, e)
            return _err(422, f"file: image could not be decoded ({type(e).__name__}: {e})")
        return {
            "labels": [{"label": lbl, "probability": float(p)} for lbl, p in top],
            "model_version": loaded.version,
        }

    return app


def app_from_env() -> FastAPI:
    """Factory for ``uvicorn --factory`` / ``--workers N``: the config comes in ``MARIANA_SERVE_CONFIG``."""
    return create_app(ServeConfig.from_json(os.environ["MARIANA_SERVE_CONFIG"]))
