"""What an app's REST routes get from the server: `AppContext`, the server's `ServeConfig`, and the JSON
error reply every route uses.

``mariana serve`` mounts the `fastapi.APIRouter` each servable app's ``AppSpec.routes`` returns for one
`AppContext`: the app's `ModelSlot` (None when no model of that app was given: the routes answer
`not_served`), the server config and metrics, the inference thread, and the routes' body limits and
micro-batchers, which the server's middleware enforces and its lifespan starts. `ServeConfig` lives here
so that this module, which `app` imports, imports nothing back from it.

The service's Prometheus metrics (`Registry`) are `prometheus_client`'s, with one `CollectorRegistry` per app
instance (several apps in one process, as in the tests, never share series); ``Registry.render()`` -> the
``GET /metrics`` body (text format 0.0.4). The library's metrics are thread-safe: updates come from the
event loop thread and the inference threads.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse
from mariana.platform.core.errors import MarianaError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import disable_created_metrics

from .batcher import MicroBatcher

log = logging.getLogger("mariana.serving")

if TYPE_CHECKING:
    from .models import ModelSlot


@dataclass
class ServeConfig:
    """Everything ``mariana serve`` passes to the app (also JSON-serialisable for ``--workers N``)."""

    models: dict[str, str] = field(default_factory=dict)  # app name -> run directory
    max_batch: int = 2048  # instances per model call
    max_wait_ms: float = 1.0  # longest a queued request waits for requests already in the server
    max_instances: int = 10_000  # per request
    max_body_bytes: int = 16 * 1024 * 1024  # JSON prediction bodies
    max_upload_bytes: int = 16 * 1024 * 1024  # file uploads (audio, images)
    max_queue: int = 200_000  # instances waiting before requests are refused with 429
    inline_max: int = 64  # micro-batches up to this size run on the event loop thread (no thread hop)
    threads: int = 0  # torch intra-op threads; 0 = cores / workers
    workers: int = 1
    watch: bool = False
    watch_interval_s: float = 2.0
    # POST /v1/admin/reload may switch only to run dirs inside these folders (symlinks resolved); empty:
    # the folders holding the run dirs served at start (runs/day1 -> any run under runs/)
    reload_roots: list[str] = field(default_factory=list)
    runtime: str = "torch"  # or "onnxruntime": the models' ONNX exports (`onnx_runtime`)
    token: str | None = None  # bearer token: needed by /v1/admin/* always, by anything from off loopback

    def roots(self) -> list[Path]:
        """The resolved folders ``/v1/admin/reload`` may take a run dir from, each once (three runs under
        runs/ give runs/ once, as does a --reload-root repeated or named through a symlink)."""
        dirs = self.reload_roots or [str(Path(d).resolve().parent) for d in self.models.values()]
        return list(dict.fromkeys(Path(d).resolve() for d in dirs))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ServeConfig:
        return cls(**json.loads(text))


class RequestError(MarianaError):
    """A request the model cannot answer, with its HTTP status (answered ``{"error": message}``)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error(status: int, message: str, **extra) -> JSONResponse:
    """The service's client-error reply: ``{"error": message, ...}`` with HTTP ``status``."""
    return JSONResponse({"error": message, **extra}, status_code=status)


disable_created_metrics()  # no ``*_created`` series: the exposition keeps the series it always had

# Latency buckets in seconds: fine below 10 ms, where the service's targets are.
LATENCY = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
BATCH = tuple(2**i for i in range(14))  # instances per model call: 1 .. 8192
# attribute, kind, name (a counter's exposed with ``_total``), labels, histogram buckets, help
METRICS = [
    ("requests", Counter, "mariana_http_requests", "route status", None, "HTTP requests by route and status code"),
    ("latency", Histogram, "mariana_http_request_duration_seconds", "route", LATENCY,
     "HTTP request latency in seconds by route"),
    ("batch_size", Histogram, "mariana_batch_size", "app", BATCH, "instances per model call (micro-batch size)"),
    ("batch_latency", Histogram, "mariana_batch_duration_seconds", "app", LATENCY,
     "seconds per model call (parse + predict)"),
    ("queue_depth", Gauge, "mariana_queue_depth", "app", None, "instances waiting for the model (micro-batch queue)"),
    ("instances", Counter, "mariana_instances", "app result", None, "instances answered, by result (ok|error)"),
    ("model_info", Gauge, "mariana_model_info", "app version run_dir", None,
     "the model version being served (value 1)"),
    ("reloads", Counter, "mariana_model_reloads", "app result", None, "model reload attempts by result (ok|failed)"),
]  # fmt: skip


class Registry:
    """The service's metrics: attributes named as in `METRICS`, labelled `prometheus_client` metrics
    (``.labels(...).inc()``, ``.observe(x)``, ``.set(x)``)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        for attr, kind, name, labels, buckets, doc in METRICS:
            extra = {"buckets": buckets} if buckets else {}
            setattr(self, attr, kind(name, doc, labels.split(), registry=self.registry, **extra))
        self._info: dict[str, tuple[str, str, str]] = {}  # app -> its model_info labels

    def serving(self, app: str, version: str, run_dir: str) -> None:
        """``mariana_model_info{app,version,run_dir} 1`` for ``app``'s new model, its previous series gone."""
        if (old := self._info.pop(app, None)) is not None:
            self.model_info.remove(*old)
        self._info[app] = (app, version, run_dir)
        self.model_info.labels(app, version, run_dir).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class AppContext:
    """One app's view of the server (see the module docstring)."""

    def __init__(
        self,
        app: str,
        cfg: ServeConfig,
        metrics: Registry,
        slot: ModelSlot | None = None,
        executor: ThreadPoolExecutor | None = None,
    ):
        self.app, self.cfg, self.metrics, self.slot, self.executor = app, cfg, metrics, slot, executor
        self.limits: dict[str, tuple[int, bool]] = {}  # path -> (largest body, JSON content type only)
        self.batchers: dict[str, MicroBatcher] = {}  # path -> its micro-batcher
        self.v2: tuple | None = None  # (path, inputs, outputs, infer) of `open_inference`

    @property
    def served(self) -> bool:
        return self.slot is not None

    def json_body(self, path: str) -> None:
        """``path`` takes a JSON body (Content-Type application/json) of at most ``--max-body-bytes``."""
        self.limits[path] = (self.cfg.max_body_bytes, True)

    def upload_body(self, path: str) -> None:
        """``path`` takes a file upload of at most ``--max-upload-bytes``."""
        self.limits[path] = (self.cfg.max_upload_bytes, False)

    def micro_batcher(self, path: str, fn: Callable[[list], tuple[list, Any]]) -> MicroBatcher:
        """A `MicroBatcher` running ``fn`` on this app's inference thread for the requests of ``path``
        (their arrival is announced to it, so it waits for requests already inside the server); its
        batch sizes, latencies and queue depth go to the metrics under this app's label."""
        mt = self.metrics
        size, seconds, depth = (m.labels(self.app) for m in (mt.batch_size, mt.batch_latency, mt.queue_depth))
        batcher = MicroBatcher(
            fn,
            self.executor,
            max_batch=self.cfg.max_batch,
            max_wait_s=self.cfg.max_wait_ms / 1000.0,
            max_queue=self.cfg.max_queue,
            inline_max=self.cfg.inline_max,
            on_batch=lambda n, s: (size.observe(n), seconds.observe(s)),
            on_queue=depth.set,
        )
        depth.set(0)
        self.batchers[path] = batcher
        return batcher

    def open_inference(self, path: str, inputs: tuple, outputs: tuple, infer: Callable) -> None:
        """This app's model in the Open Inference Protocol (`mariana.serving.open_inference`): its tensors as
        ``(name, datatype, shape)`` (-1: any size), ``await infer({input: flat list}, parameters) ->
        ({output: nested list}, model_version)`` the code path of the /v1 route ``path``, whose body limit
        (any content type: the binary extension is not JSON) and micro-batcher ``/v2/models/APP/infer`` shares."""
        self.v2 = (path, inputs, outputs, infer)
        v2 = f"/v2/models/{self.app}/infer"
        self.limits[v2] = (self.limits[path][0], False)
        if path in self.batchers:
            self.batchers[v2] = self.batchers[path]

    async def run(self, fn, *args):
        """Run a (non-batched) model call on this app's inference thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def on_upload(self, method: str, data: bytes, field: str, valid: bool, expected: str, *args):
        """``current model.<method>(data, *args)`` on the inference thread for an uploaded file -> (its
        answer, the model version); RequestError naming ``field``: 422 when it is empty or cannot be
        decoded, 415 when not ``valid`` (its header is not ``expected``'s)."""
        if not data:
            raise RequestError(422, f"{field}: empty upload")
        if not valid:
            raise RequestError(415, f"{field}: not {expected}")
        loaded = self.slot.current  # the answer comes from this version even if a reload lands
        try:
            return await self.run(getattr(loaded.obj, method), data, *args), loaded.version
        except MarianaError as e:
            raise RequestError(422, f"{field}: {e}") from None
        except Exception as e:  # noqa: BLE001  -- a corrupt file must not become a 500
            # The detail goes to the server log; the client gets a plain message, not an internal one.
            log.warning("%s: upload rejected: %s: %s", self.app, type(e).__name__, e)
            raise RequestError(
                422, f"{field}: could not be decoded as {expected} ({type(e).__name__})"
            ) from None

    def not_served(self) -> JSONResponse:
        return error(404, f"{self.app} is not served here (start the server with --{self.app} RUN)")
