"""What the tuner needs to know about each app: its train config class and its default metric.

``monitor`` names the metric without prefix: trials write it as ``eval_<m>`` records to ``RUN/metrics.jsonl``
while training (``--eval-every``) and as ``val_<m>`` / ``eval_<m>`` in ``RUN/metrics.json`` at the end.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from mariana.platform.core.errors import MarianaError


@dataclass(frozen=True)
class AppInfo:
    module: str  # configs module
    config_class: str
    monitor: str  # default metric
    direction: str  # "maximize" | "minimize"

    def config_cls(self) -> type:
        return getattr(importlib.import_module(self.module), self.config_class)

    def presets(self) -> dict:
        return getattr(importlib.import_module(self.module), "PRESETS", {})


APPS = {
    "pctr": AppInfo("mariana.apps.pctr.configs", "PctrConfig", "auc", "maximize"),
    "vision": AppInfo("mariana.apps.vision.configs", "VisionConfig", "top1", "maximize"),
    "asr": AppInfo("mariana.apps.asr.configs", "AsrConfig", "wer", "minimize"),
    "mlp": AppInfo("mariana.platform.mlpjob.configs", "MlpConfig", "auc", "maximize"),
}

# Fields a search space may not set: where the run goes and how the config is given are the tuner's.
RESERVED = {"out", "config", "resume", "data"}


def app_info(app: str) -> AppInfo:
    if app not in APPS:
        raise MarianaError(f"unknown app {app!r}: expected one of {', '.join(sorted(APPS))}")
    return APPS[app]
