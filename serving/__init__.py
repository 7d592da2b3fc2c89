"""Low-latency REST serving of the trained models (``mariana serve``, serving/README.md): `app` (the FastAPI
app), `context` (what an app's routes get), `batcher` (micro-batching), `models` (loading, hot reload),
`metrics`, `open_inference` (/v2), `cli` (the parser). No app is named here: the apps come from the
registry (`mariana.platform.core.registry`)."""
