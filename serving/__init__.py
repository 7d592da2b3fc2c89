"""Low-latency REST serving of the trained models (``mariana serve``).

Modules: `app` (FastAPI routes, error mapping, body limits), `batcher` (micro-batching onto one inference
thread), `models` (loading through the apps' inference APIs, atomic hot reload, ``--watch``), `metrics`
(Prometheus text format), `cli` (the ``serve`` subcommand).
"""
