"""Optuna studies (``mariana tune``) in the job service: their REST API and web page.

- ``GET /api/tune/storage``    the service database's URL, where a tuner stores its study (loopback only:
                               it may hold a password)
- ``GET /api/studies``         ``{"studies": [{name, direction, n_trials, best_value, app, monitor}, ...]}``
- ``GET /api/studies/{name}``  the study: every trial (number, state, value, params, intermediate values
                               by step, start/end times, job id) and parameter importances (Optuna's
                               default evaluator; null until two trials completed)
- ``GET /studies``, ``GET /studies/{name}``  the pages (``static/studies.html`` + ``studies.js``)

Optuna is imported on the first request, so a service that never sees a study does not pay for it.
"""

from __future__ import annotations

import threading

from fastapi import FastAPI, HTTPException, Request

LOOPBACK = {"127.0.0.1", "::1", "localhost", "testclient"}


def _time(dt) -> float | None:
    return dt.timestamp() if dt is not None else None


def mount_studies(app: FastAPI, page) -> None:
    """Add the study API and pages to ``app`` (its ``state.db`` is the service's `Database`);
    ``page(name)`` returns an HTML page response."""
    lock = threading.Lock()
    cache: dict = {"storage": None, "importance": {}}

    def db():
        d = getattr(app.state, "db", None)
        if d is None:
            raise HTTPException(404, "this server has no job database")
        return d

    def storage():
        with lock:
            if cache["storage"] is None:
                import optuna

                optuna.logging.set_verbosity(optuna.logging.WARNING)
                url = db().engine.url.render_as_string(hide_password=False)
                kw = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {}
                cache["storage"] = optuna.storages.RDBStorage(url, engine_kwargs=kw)
            return cache["storage"]

    @app.get("/api/tune/storage")
    def tune_storage(request: Request) -> dict:
        """The database URL for `mariana tune`'s Optuna storage (the service's own database)."""
        if (request.client.host if request.client else "") not in LOOPBACK:
            raise HTTPException(403, "the storage URL is given to loopback clients only")
        return {"url": db().engine.url.render_as_string(hide_password=False)}

    @app.get("/api/studies")
    def list_studies() -> dict:
        import optuna

        out = []
        for s in optuna.get_all_study_summaries(storage(), include_best_trial=True):
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

    @app.get("/api/studies/{name}")
    def show_study(name: str) -> dict:
        import optuna
        from optuna.trial import TrialState

        try:
            study = optuna.load_study(study_name=name, storage=storage())
        except KeyError:
            raise HTTPException(404, f"no study {name!r}") from None
        trials = study.get_trials(deepcopy=False)
        from mariana.platform.tune.study import trial_row

        # The page sorts by the final value only: a pruned trial shows none (its curve shows how far it got).
        rows = [
            {**trial_row(t), "value": t.value, "intermediate": sorted(t.intermediate_values.items())}
            for t in trials
        ]
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        key = (name, len(complete))
        importance, note = cache["importance"].get(key, (None, None))
        if key not in cache["importance"]:
            try:
                imp = optuna.importance.get_param_importances(study) if len(complete) >= 2 else None
                importance = {k: float(v) for k, v in imp.items()} if imp else None
                note = None if importance else "needs two completed trials"
            except (RuntimeError, ValueError) as e:  # e.g. a parameter that never varied
                importance, note = None, str(e)
            cache["importance"][key] = (importance, note)
        best = study.best_trial.number if complete else None
        return {
            "name": name,
            "direction": study.direction.name.lower(),
            "user_attrs": study.user_attrs,
            "best_trial": best,
            "trials": rows,
            "importance": importance,
            "importance_note": note,
        }

    @app.get("/studies", include_in_schema=False)
    def studies_page():
        return page("studies.html")

    @app.get("/studies/{name}", include_in_schema=False)
    def study_page(name: str):
        return page("studies.html")
