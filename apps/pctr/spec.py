"""The pCTR app as the platform sees it (`mariana.platform.core.registry`); standard library imports only."""

from mariana.platform.core.registry import AppSpec, TuneInfo

SPEC = AppSpec(
    name="pctr",
    cli="mariana.apps.pctr.cli",
    loader="mariana.apps.pctr.routes:load_for_serving",  # load_predictor + one warm-up prediction
    routes="mariana.apps.pctr.routes:router",
    serve_help="pCTR run directory -> POST /v1/pctr/predict",
    requires=("predict_lines",),
    tune=TuneInfo("mariana.apps.pctr.configs", "PctrConfig", "auc"),
    extra_slots=("--servers",),  # parameter-server processes run beside the --workers
    order=30,
)
