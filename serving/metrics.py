"""The service's Prometheus metrics, on `prometheus_client` with one `CollectorRegistry` per app instance
(several apps in one process, as in the tests, never share series); ``Registry.render()`` -> the
``GET /metrics`` body (text format 0.0.4). The library's metrics are thread-safe: updates come from the
event loop thread and the inference threads.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import disable_created_metrics

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
