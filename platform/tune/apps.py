"""What the tuner needs to know about each app: its `TuneInfo` (train config class, default metric), taken
from the app registry (`mariana.platform.core.registry`; apps whose spec has ``tune``)."""

from __future__ import annotations

from mariana.platform.core.errors import MarianaError
from mariana.platform.core.registry import TuneInfo, find_app, tunable_apps

AppInfo = TuneInfo  # the name the tuner's modules use

# Fields a search space may not set: where the run goes and how the config is given are the tuner's.
RESERVED = {"out", "config", "resume", "data"}


def tunable() -> list[str]:
    """Names of the apps ``mariana tune`` accepts."""
    return [s.name for s in tunable_apps()]


def app_info(app: str) -> AppInfo:
    spec = find_app(app)
    if spec is None or spec.tune is None:
        raise MarianaError(f"unknown app {app!r}: expected one of {', '.join(sorted(tunable()))}")
    return spec.tune
