"""The application registry: every application declares itself once, in an `AppSpec`.

An app (``apps/<app>/spec.py``, the smoke-test job in ``apps/mlp/spec.py``) exposes ``SPEC =
AppSpec(...)`` and names it in ``pyproject.toml`` under the ``mariana.apps`` entry-point group::

    [project.entry-points."mariana.apps"]
    myapp = "mypackage.spec:SPEC"

The platform (the ``mariana`` command, ``mariana serve``, the job service, the tuner) finds the apps only
through `all_apps` / `get_app`, never by name, so an app is added or removed without touching the platform.
A spec refers to its code by ``"module:attribute"`` strings resolved on first use: reading the registry
imports only the spec modules (standard library), which keeps ``mariana --help`` fast.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from .errors import MarianaError

GROUP = "mariana.apps"


def resolve(ref: str) -> Any:
    """``"package.module:attr"`` -> that attribute (the module is imported now); ``"package.module"`` ->
    the module."""
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class TuneInfo:
    """What ``mariana tune`` needs: the train config class and the default metric.

    ``monitor`` names the metric without prefix: trials write it as ``eval_<m>`` records to
    ``RUN/metrics.jsonl`` while training (``--eval-every``) and as ``val_<m>`` / ``eval_<m>`` in
    ``RUN/metrics.json`` at the end."""

    module: str  # the configs module (holds the config class and PRESETS)
    config_class: str
    monitor: str  # default metric (its direction comes from `evaluator.higher_is_better`)

    def config_cls(self) -> type:
        return getattr(importlib.import_module(self.module), self.config_class)

    def presets(self) -> dict:
        return getattr(importlib.import_module(self.module), "PRESETS", {})


@dataclass(frozen=True)
class AppSpec:
    """One application, as the platform sees it.

    - ``name``: the command group (``mariana NAME ...``), the ``mariana serve --NAME RUN`` flag, the
      ``app`` of its exported models.
    - ``cli``: module with ``register(subparsers)`` adding the ``mariana NAME`` commands (stdlib imports
      only at module level).
    - ``loader``: ``"module:function"``, ``function(run_dir) -> inference object`` ready to serve (with a
      ``version`` attribute: the exported weights' digest); None: the app is not served.
    - ``routes``: ``"module:function"``, ``function(ctx: mariana.serving.context.AppContext) ->
      fastapi.APIRouter`` with the app's REST routes (``ctx.slot`` is None when no model of the app is
      served: the routes then answer 404, so the API schema does not depend on the command line).
    - ``serve_help``: the help of ``mariana serve --NAME``; ``requires``: methods the inference object
      must have (checked at load, so a wrong run directory is refused up front).
    - ``tune``: `TuneInfo` (None: not tunable); ``extra_slots``: flags of ``train`` whose values count
      processes besides ``--workers`` (the job scheduler's slot budget); ``order``: position in listings.
    """

    name: str
    cli: str
    loader: str | None = None
    routes: str | None = None
    serve_help: str = ""
    requires: tuple[str, ...] = ()
    tune: TuneInfo | None = None
    extra_slots: tuple[str, ...] = ()
    order: int = 100

    @property
    def servable(self) -> bool:
        return self.loader is not None and self.routes is not None

    def load(self, run_dir: str) -> Any:
        """The app's inference object for the model exported in ``run_dir`` (imports the app's modules)."""
        if self.loader is None:
            raise MarianaError(f"{self.name} models cannot be served (its spec has no loader)")
        return resolve(self.loader)(run_dir)

    def router(self, ctx: Any) -> Any:
        if self.routes is None:
            raise MarianaError(f"{self.name} has no REST routes")
        return resolve(self.routes)(ctx)


def _missing_own_module(e: ModuleNotFoundError, ref: str) -> bool:
    """The entry point names a module of this distribution that is not part of this build."""
    return bool(e.name) and ref.split(":", 1)[0].startswith(e.name)


@cache
def _registry() -> dict[str, AppSpec]:
    from importlib.metadata import entry_points

    found: dict[str, AppSpec] = {}
    for ep in entry_points(group=GROUP):
        if ep.name in found:  # the same distribution seen twice on sys.path: the first one wins
            continue
        try:
            spec = ep.load()
        except ModuleNotFoundError as e:
            if _missing_own_module(e, ep.value):  # that app is not part of this build
                continue
            raise
        if not isinstance(spec, AppSpec) or spec.name != ep.name:
            raise MarianaError(
                f"entry point {GROUP}:{ep.name} = {ep.value} is not an AppSpec named {ep.name!r}"
            )
        found[ep.name] = spec
    return dict(sorted(found.items(), key=lambda kv: (kv[1].order, kv[0])))


def all_apps() -> list[AppSpec]:
    """Every registered app, in listing order (``order``, then name)."""
    return list(_registry().values())


def find_app(name: str) -> AppSpec | None:
    """The app called ``name``, or None (a platform command such as ``jobs``, or a typo)."""
    return _registry().get(name)


def get_app(name: str) -> AppSpec:
    """The app called ``name``; MarianaError naming the registered apps when there is none."""
    spec = find_app(name)
    if spec is None:
        names = ", ".join(sorted(_registry())) or "none (is mariana installed? `pip install -e .`)"
        raise MarianaError(f"unknown app {name!r}: expected one of {names}")
    return spec


def serving_apps() -> list[AppSpec]:
    """The apps ``mariana serve`` can serve (a loader and routes), in listing order."""
    return [s for s in all_apps() if s.servable]


def tunable_apps() -> list[AppSpec]:
    return [s for s in all_apps() if s.tune is not None]


# ------------------------------------------------------------------------------------------------ models
# One way apps register their models (timm's idiom): ``@register_model("vision", "resnet9")`` on a factory
# (a function or a class) ``f(**kwargs) -> torch.nn.Module``, and ``create_model("vision", "resnet9", ...)``.
# Names are per app (asr and pctr both have a "dnn"); the kwargs are the app's own (the same for every model
# of one app). A model module registers its models when it is imported.
_MODELS: dict[str, dict[str, Callable[..., Any]]] = {}


def register_model(app: str, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``factory`` as ``app``'s model ``name`` (ValueError for a name another module
    registered) and return it unchanged."""

    def register(factory: Callable[..., Any]) -> Callable[..., Any]:
        table = _MODELS.setdefault(app, {})
        if name in table and _module_of(table[name]) != _module_of(factory):  # the same module: reloaded
            raise ValueError(f"{app} model {name!r} is registered twice ({table[name]} and {factory})")
        table[name] = factory
        return factory

    return register


def _module_of(factory: Callable[..., Any]) -> str | None:
    return getattr(getattr(factory, "func", factory), "__module__", None)  # a partial: its function's


def create_model(app: str, name: str, **kwargs: Any) -> Any:
    """``app``'s model ``name`` built with ``kwargs``; MarianaError naming the registered ones for an
    unknown name."""
    factory = _MODELS.get(app, {}).get(name)
    if factory is None:
        raise MarianaError(f"unknown {app} model {name!r}: choose one of {', '.join(list_models(app))}")
    return factory(**kwargs)


def list_models(app: str | None = None) -> list[str]:
    """The names of ``app``'s registered models, in registration order; without ``app``, every model as
    ``"app/name"``."""
    if app is not None:
        return list(_MODELS.get(app, {}))
    return [f"{a}/{n}" for a, table in _MODELS.items() for n in table]
