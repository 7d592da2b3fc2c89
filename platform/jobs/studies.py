"""Optuna studies (``mariana tune``) in the job service: their REST API (``router``; the pages are in
``ui.py``): ``/api/tune/storage`` (the database URL a tuner stores its study in; loopback only: it may hold
a password), ``/api/studies`` and ``/api/studies/{name}`` (every trial and the parameter importances, null
until two trials completed). Optuna is imported on the first request, so a service that never sees a study
does not pay for it.
"""

from __future__ import annotations

import threading
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request
from mariana.platform.core.listen import LOOPBACK

from .db import Database
from .trials import trial_row

router = APIRouter()


class StudyStore:
    """The service database as Optuna's storage (opened on first use) and the parameter importances
    computed so far (per study and count of completed trials: Optuna's evaluator takes seconds)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._storage = None
        self._importance: dict[tuple[str, int], tuple[dict | None, str | None]] = {}

    def storage(self, db: Database):
        with self._lock:
            if self._storage is None:
                import optuna

                optuna.logging.set_verbosity(optuna.logging.WARNING)
                url = db.engine.url.render_as_string(hide_password=False)
                kw = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {}
                self._storage = optuna.storages.RDBStorage(url, engine_kwargs=kw)
            return self._storage

    def importance(self, study, n_complete: int) -> tuple[dict | None, str | None]:
        """-> ({param: importance} or None, why None); computed once per number of completed trials."""
        import optuna

        key = (study.study_name, n_complete)
        if key not in self._importance:
            try:
                imp = optuna.importance.get_param_importances(study) if n_complete >= 2 else None
                importance = {k: float(v) for k, v in imp.items()} if imp else None
                note = None if importance else "needs two completed trials"
            except (RuntimeError, ValueError) as e:  # e.g. a parameter that never varied
                importance, note = None, str(e)
            self._importance[key] = (importance, note)
        return self._importance[key]


def _db(request: Request) -> Database:
    d = getattr(request.app.state, "db", None)
    if d is None:
        raise HTTPException(404, "this server has no job database")
    return d


def _store(request: Request) -> StudyStore:
    return request.app.state.studies


DB = Annotated[Database, Depends(_db)]
Store = Annotated[StudyStore, Depends(_store)]


def _time(dt) -> float | None:
    return dt.timestamp() if dt is not None else None


@router.get("/api/tune/storage")
def tune_storage(request: Request, db: DB) -> dict:
    """The database URL for `mariana tune`'s Optuna storage (the service's own database)."""
    if (request.client.host if request.client else "") not in LOOPBACK:
        raise HTTPException(403, "the storage URL is given to loopback clients only")
    return {"url": db.engine.url.render_as_string(hide_password=False)}


@router.get("/api/studies")
def list_studies(db: DB, store: Store) -> dict:
    import optuna

    out = []
    for s in optuna.get_all_study_summaries(store.storage(db), include_best_trial=True):
        out.append(
            {
                "name": s.study_name,
                "direction": s.direction.name.lower(),
                "n_trials": s.n_trials,
                "best_value": s.best_trial.value if s.best_trial is not None else None,
                "app": s.user_attrs.get("app"),
                "monitor": s.user_attrs.get("monitor"),
                "started": _time(s.datetime_start),
            }
        )
    return {"studies": out}


@router.get("/api/studies/{name}")
def show_study(name: str, db: DB, store: Store) -> dict:
    import optuna

    try:
        study = optuna.load_study(study_name=name, storage=store.storage(db))
    except KeyError:
        raise HTTPException(404, f"no study {name!r}") from None
    trials = study.get_trials(deepcopy=False)
    # The page sorts by the final value only: a pruned trial shows none (its curve shows how far it got).
    rows = [
        {**trial_row(t), "value": t.value, "intermediate": sorted(t.intermediate_values.items())}
        for t in trials
    ]
    n_complete = sum(t.state.name == "COMPLETE" for t in trials)
    importance, note = store.importance(study, n_complete)
    return {
        "name": name,
        "direction": study.direction.name.lower(),
        "user_attrs": study.user_attrs,
        "best_trial": study.best_trial.number if n_complete else None,
        "trials": rows,
        "importance": importance,
        "importance_note": note,
    }


def mount_studies(app) -> None:
    """Add the study API to ``app`` (its ``state.db``, when set, is the service's `Database`)."""
    app.state.studies = StudyStore()
    app.include_router(router)
