"""The vision app as the platform sees it (`mariana.platform.core.registry`); standard library imports only."""

from mariana.platform.core.registry import AppSpec, TuneInfo

SPEC = AppSpec(
    name="vision",
    cli="mariana.apps.vision.cli",
    loader="mariana.apps.vision.predict:load_classifier",
    routes="mariana.apps.vision.routes:router",
    serve_help="vision run directory -> POST /v1/vision/classify",
    requires=("classify_bytes",),
    tune=TuneInfo("mariana.apps.vision.configs", "VisionConfig", "top1"),
    order=20,
)
