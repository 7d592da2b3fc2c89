"""The smoke-test job as the platform sees it (`mariana.platform.core.registry`): trained, evaluated and
tuned like the applications, not served."""

from mariana.platform.core.registry import AppSpec, TuneInfo

SPEC = AppSpec(
    name="mlp",
    cli="mariana.apps.mlp.cli",
    tune=TuneInfo("mariana.apps.mlp.configs", "MlpConfig", "auc"),
    order=0,
)
