"""Prometheus metrics in the text exposition format (version 0.0.4), written without a client library.

Counters, gauges and histograms keyed by label tuples; ``Registry.render()`` -> the ``GET /metrics`` body.
Updates happen on the event loop thread and the inference thread, so each metric holds a lock (cheap next
to an HTTP request: ~100 ns uncontended).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence

# Latency buckets in seconds: fine below 10 ms, where the service's targets are.
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
# Batch sizes (instances per model call).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if float(x).is_integer():
        return str(int(x))
    return repr(float(x))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        self.name, self.help, self.labelnames = name, help, tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str] | None) -> tuple[str, ...]:
        labels = labels or {}
        return tuple(str(labels.get(n, "")) for n in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A monotonically increasing count per label set."""

    kind = "counter"

    def __init__(self, name, help, labelnames=()):
        super().__init__(name, help, labelnames)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, labels: dict[str, str] | None = None, amount: float = 1.0) -> None:
        k = self._key(labels)
        with self._lock:
            self._values[k] = self._values.get(k, 0.0) + amount

    def lines(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return [f"{self.name}{_labels(self.labelnames, k)} {_num(v)}" for k, v in items]


class Gauge(Counter):
    """A value that goes up and down (queue depth, model info)."""

    kind = "gauge"

    def set(self, value: float, labels: dict[str, str] | None = None) -> None:
        with self._lock:
            self._values[self._key(labels)] = float(value)

    def set_exclusive(self, value: float, labels: dict[str, str], by: str) -> None:
        """Set ``labels`` and drop every other series with the same ``by`` label (one version per app)."""
        i = self.labelnames.index(by)
        k = self._key(labels)
        with self._lock:
            for old in [o for o in self._values if o[i] == k[i]]:
                del self._values[old]
            self._values[k] = float(value)


class Histogram(_Metric):
    """Cumulative-bucket histogram per label set: ``_bucket{le=..}``, ``_sum``, ``_count``."""

    kind = "histogram"

    def __init__(self, name, help, labelnames=(), buckets: Iterable[float] = LATENCY_BUCKETS):
        super().__init__(name, help, labelnames)
        self.buckets = tuple(sorted(float(b) for b in buckets))
        self._data: dict[tuple[str, ...], list] = {}  # key -> [counts per bucket (+Inf last), sum]

    def observe(self, value: float, labels: dict[str, str] | None = None) -> None:
        k = self._key(labels)
        # First bucket whose bound >= value (non-cumulative here; made cumulative on render).
        i = len(self.buckets)
        for j, b in enumerate(self.buckets):
            if value <= b:
                i = j
                break
        with self._lock:
            d = self._data.get(k)
            if d is None:
                d = self._data[k] = [[0] * (len(self.buckets) + 1), 0.0]
            d[0][i] += 1
            d[1] += value

    def lines(self) -> list[str]:
        with self._lock:
            items = sorted((k, (list(d[0]), d[1])) for k, d in self._data.items())
        out = []
        for k, (counts, total) in items:
            acc = 0
            for b, c in zip((*self.buckets, math.inf), counts):
                acc += c
                le = 'le="' + _num(b) + '"'
                out.append(f"{self.name}_bucket{_labels(self.labelnames, k, le)} {acc}")
            out.append(f"{self.name}_sum{_labels(self.labelnames, k)} {_num(total)}")
            out.append(f"{self.name}_count{_labels(self.labelnames, k)} {acc}")
        return out


class Registry:
    """The service's metrics; ``render()`` is the Prometheus text body."""

    def __init__(self):
        self.requests = Counter(
            "mariana_http_requests_total", "HTTP requests by route and status code", ("route", "status")
        )
        self.latency = Histogram(
            "mariana_http_request_duration_seconds", "HTTP request latency in seconds by route", ("route",)
        )
        self.batch_size = Histogram(
            "mariana_batch_size", "instances per model call (micro-batch size)", ("app",), BATCH_BUCKETS
        )
        self.batch_latency = Histogram(
            "mariana_batch_duration_seconds", "seconds per model call (parse + predict)", ("app",)
        )
        self.queue_depth = Gauge(
            "mariana_queue_depth", "instances waiting for the model (micro-batch queue)", ("app",)
        )
        self.instances = Counter(
            "mariana_instances_total", "instances answered, by result (ok|error)", ("app", "result")
        )
        self.model_info = Gauge(
            "mariana_model_info", "the model version being served (value 1)", ("app", "version", "run_dir")
        )
        self.reloads = Counter(
            "mariana_model_reloads_total", "model reload attempts by result (ok|failed)", ("app", "result")
        )
        self.all = [m for m in vars(self).values() if isinstance(m, _Metric)]  # in the order above

    def render(self) -> str:
        out: list[str] = []
        for m in self.all:
            out += m.header()
            out += m.lines()
        return "\n".join(out) + "\n"
