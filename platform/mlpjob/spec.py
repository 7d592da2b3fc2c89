"""The smoke-test job as the platform sees it (`mariana.platform.core.registry`): trained, evaluated and
tuned like the applications, not served."""

from ..core.registry import AppSpec, TuneInfo

SPEC = AppSpec(
    name="mlp",
    cli="mariana.platform.mlpjob.cli",
    tune=TuneInfo("mariana.platform.mlpjob.configs", "MlpConfig", "auc"),
    order=0,
)
