"""Low-latency REST serving of the trained models (``mariana serve``).

Modules: `app` (the FastAPI app: one router per app from its spec, the generic routes, error mapping, body
limits), `context` (`AppContext`: what an app's routes get from the server; the server's `ServeConfig`),
`batcher` (micro-batching onto one inference thread), `models` (loading through the apps' serving loaders,
atomic hot reload, ``--watch``), `metrics` (Prometheus text format), `cli` (the ``serve`` subcommand); the
load generator of the latency tests is `bench/loadgen.py`. No app is named here: the apps come from the
registry (`mariana.platform.core.registry`).
"""
