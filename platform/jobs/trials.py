"""One Optuna trial as a JSON-able row: what the job service's study page and ``mariana tune``'s results
table and ``results.json`` show (the tuner builds on the job service, so the row lives here, below both)."""

from __future__ import annotations


def trial_value(t) -> float | None:
    """A completed trial's value; a pruned one's last reported value; None for failed ones."""
    if t.state.name == "COMPLETE":
        return t.value
    if t.state.name == "PRUNED" and t.intermediate_values:
        return t.intermediate_values[max(t.intermediate_values)]
    return None


def used_params(t) -> dict:
    """The parameters trial ``t`` (a live or frozen Optuna trial) actually ran with: those that applied to
    its values (the tuner records them as the ``params`` user attribute; e.g. no ``dim`` for
    ``model = "lr"``), else every sampled one (trials from before that attribute)."""
    used = t.user_attrs.get("params")
    return dict(used) if isinstance(used, dict) else dict(t.params)


def trial_row(t) -> dict:
    """One Optuna trial (a ``FrozenTrial``) -> {number, state, value (a pruned trial's last reported value),
    params, error, run_dir, job_id, started/ended (unix s), duration_s}."""
    start, end = t.datetime_start, t.datetime_complete
    return {
        "number": t.number,
        "state": t.state.name.lower(),
        "value": trial_value(t),
        "params": used_params(t),
        "error": t.user_attrs.get("error"),
        "run_dir": t.user_attrs.get("run_dir"),
        "job_id": t.user_attrs.get("job_id"),
        "started": start.timestamp() if start else None,
        "ended": end.timestamp() if end else None,
        "duration_s": (end - start).total_seconds() if start and end else None,
    }
