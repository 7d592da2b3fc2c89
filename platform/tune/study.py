"""The tuning loop: Optuna ask/tell with P trials in flight, pruning from the trials' eval records.

``run_study(opts) -> int`` is ``mariana tune`` (the outputs under TUNE_DIR: ``platform/tune/README.md``;
``study.json`` says what the study is, so a second run with the same ``--out`` continues it).

Pruning: each trial's new ``eval_<metric>`` records are reported as they appear; when the pruner says so the
trial's process group (or job) is cancelled and it is PRUNED, also when it ended before the tuner read the
records, so which trials are pruned does not depend on how fast the tuner polls.

Resuming: trials a killed tuner left RUNNING are stopped, FAILed with ``interrupted = true`` (not counted
towards ``--trials``) and re-queued with the same parameters, so every sampled configuration is evaluated
exactly once. The sampler's seed is ``--seed`` plus the trials already in the study, so a resumed study does
not draw the first configurations again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mariana.platform.core.atomic import atomic_write_text
from mariana.platform.core.config import applicable_values, read_config_values, sectioned_toml
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.jsonfile import read_json
from mariana.platform.core.tracking import PARENT_ENV
from mariana.platform.jobs.logstore import parse_record, read_lines
from mariana.platform.jobs.scheduler import PRUNED
from mariana.platform.jobs.trials import trial_row, used_params

from .apps import RESERVED, AppInfo
from .space import Space, flag_args

POLL_S = 0.25


@dataclass
class TuneOptions:
    app: str
    info: AppInfo
    space: Space
    trials: int
    parallel: int
    out: Path
    monitor: str
    direction: str  # maximize | minimize
    timeout: float
    pruner: str
    seed: int
    train_flags: list[str]
    url: str | None  # job service URL (None: local processes)
    client: Any = None


@dataclass
class InFlight:
    trial: Any  # optuna.trial.Trial
    handle: dict
    run_dir: Path
    offset: int = 0  # bytes of metrics.jsonl already read
    reported: list[tuple[int, float]] = field(default_factory=list)


def metric_value(record: dict, monitor: str, prefixes=("eval_",)) -> float | None:
    for p in prefixes:
        v = record.get(p + monitor)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return float(v)
    return None


def read_new_records(f: InFlight) -> list[dict]:
    """The JSON-object lines of RUN/metrics.jsonl completed since the last read."""
    lines, f.offset = read_lines(f.run_dir / "metrics.jsonl", f.offset)
    return [r for r in map(parse_record, lines) if r is not None]


def final_value(run_dir: Path, monitor: str) -> tuple[float | None, str]:
    """The finished trial's metric from RUN/metrics.json (``val_M``, ``eval_M`` or ``M``), or an error."""
    if (final := read_json(run_dir / "metrics.json")) is None:
        return None, f"{run_dir}/metrics.json is missing or unreadable"
    v = metric_value(final, monitor, ("val_", "eval_", ""))
    if v is None:
        keys = ", ".join(sorted(k for k, x in final.items() if isinstance(x, int | float)))
        return None, f"metrics.json has no {monitor!r} (val_/eval_ prefixed or plain); numbers there: {keys}"
    if not math.isfinite(v):
        return None, f"{monitor} is {v}"
    return v, ""


def _storage(url: str):
    import optuna

    kw = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {}
    return optuna.storages.RDBStorage(url, engine_kwargs=kw)


def _pruner(name: str, trials: int):
    import optuna

    if name == "median":
        # Compare with the median of completed trials once a quarter of the budget (2..5 trials) finished.
        return optuna.pruners.MedianPruner(n_startup_trials=max(2, min(5, trials // 4)))
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, reduction_factor=3)
    return optuna.pruners.NopPruner()


def _counted(t) -> bool:
    from optuna.trial import TrialState

    if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    return t.state == TrialState.FAIL and not t.user_attrs.get("interrupted")


def open_study(o: TuneOptions):
    """Create or load the study of ``o.out``; returns (study, storage URL, name)."""
    import optuna

    meta_path = o.out / "study.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    if meta is not None:
        if meta.get("app") != o.app:
            raise MarianaError(
                f"--out {o.out}: holds a study of `mariana tune {meta.get('app')}`, not {o.app}"
            )
        url, name = meta["storage"], meta["name"]
    else:
        name = o.out.resolve().name
        if o.client is not None:
            url = o.client.request("GET", "/api/tune/storage")["url"]
        else:
            url = f"sqlite:///{(o.out / 'study.db').resolve()}"
    storage = _storage(url)
    existing = {s.study_name: s for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    if meta is None and name in existing:
        other = existing[name].user_attrs.get("tune_dir")
        if other != str(o.out.resolve()):
            base = name
            i = 2
            while f"{base}-{i}" in existing:
                i += 1
            name = f"{base}-{i}"
    n_before = existing[name].n_trials if name in existing else 0
    study = optuna.create_study(
        storage=storage,
        study_name=name,
        sampler=optuna.samplers.TPESampler(seed=o.seed + n_before),
        pruner=_pruner(o.pruner, o.trials),
        direction=o.direction,
        load_if_exists=True,
    )
    if study.direction.name.lower() != o.direction:
        raise MarianaError(
            f"--direction: the study in {o.out} was created to {study.direction.name.lower()} its metric"
        )
    shared = [*o.train_flags, *flag_args(o.space.fixed)]  # what every trial's train command is given
    if meta is not None and meta.get("trial_flags") not in (None, shared):
        raise MarianaError(
            f"--out {o.out}: its trials ran with `{' '.join(meta['trial_flags'])}`, this run would give "
            f"new trials `{' '.join(shared)}`; trials of other budgets or data would be ranked in one "
            "table: continue with the same flags, or start a new --out"
        )
    if meta is not None and "trial_flags" not in meta:  # a study from before the check: recorded now
        meta["trial_flags"] = shared
        atomic_write_text(meta_path, json.dumps(meta, indent=1) + "\n")
    if meta is None:
        for k, v in {"tune_dir": str(o.out.resolve()), "app": o.app, "monitor": o.monitor,
                     "space": str(Path(o.space.path).resolve())}.items():  # fmt: skip
            study.set_user_attr(k, v)
        meta = {"name": name, "storage": url, "app": o.app, "monitor": o.monitor, "direction": o.direction,
                "trial_flags": shared}  # fmt: skip
        atomic_write_text(meta_path, json.dumps(meta, indent=1) + "\n")
    elif meta.get("monitor") != o.monitor:
        raise MarianaError(f"--monitor {o.monitor}: the study in {o.out} tunes {meta.get('monitor')}")
    return study, url, name


def requeue_interrupted(study, runner) -> int:
    """Trials a killed tuner left RUNNING: stop what is left of them, FAIL them (``interrupted``) and
    enqueue their parameters again where all were drawn. Returns how many were re-queued."""
    from optuna.trial import TrialState

    n = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        handle = t.user_attrs.get("handle")
        if handle:
            try:
                runner.stop_stale(handle)
            except MarianaError as e:  # e.g. the service that ran it is gone: nothing left to stop
                print(f"mariana: warning: trial {t.number}: {e}", file=sys.stderr)
        drawn = "params" in t.user_attrs  # else killed while its parameters were drawn: nothing ran
        why = "; re-queued" if drawn else " while its parameters were drawn; not re-queued"
        study._storage.set_trial_user_attr(t._trial_id, "interrupted", True)
        study._storage.set_trial_user_attr(t._trial_id, "error", f"interrupted: the tuner stopped{why}")
        study.tell(t.number, state=TrialState.FAIL)
        if drawn:
            study.enqueue_trial(t.params, user_attrs={"requeued_from": t.number})
            n += 1
    return n


def run_study(o: TuneOptions, runner) -> int:
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # o.out: made by the caller (`commands.tune`)
    study, url, name = open_study(o)
    requeued = requeue_interrupted(study, runner)
    trials_dir = o.out / "trials"
    done = sum(_counted(t) for t in study.get_trials(deepcopy=False))
    where = f"jobs of {o.url}" if o.client is not None else "local processes"
    print(
        f"study {name!r} ({url.split('://')[0]}): {done}/{o.trials} trials done"
        + (f", {requeued} interrupted trial(s) re-queued" if requeued else "")
        + f"; running up to {o.parallel} at a time as {where}",
        flush=True,
    )
    deadline = time.monotonic() + o.timeout if o.timeout > 0 else None
    flying: dict[int, InFlight] = {}
    try:
        while True:
            expired = deadline is not None and time.monotonic() > deadline
            while len(flying) < o.parallel and done + len(flying) < o.trials and not expired:
                f = _launch(study.ask(), o, runner, trials_dir)
                flying[f.trial.number] = f
            if not flying:
                break
            time.sleep(POLL_S)
            for number in list(flying):
                f = flying[number]
                status = runner.poll(f.handle)  # before reading: records written before the exit are in
                pruned = _report(f, o.monitor)
                if pruned is not None and status is None:
                    runner.cancel(f.handle, reason=f"{PRUNED} at step {pruned}")
                    runner.wait_cancelled(f.handle)
                if pruned is not None:
                    study.tell(f.trial, state=TrialState.PRUNED)
                    print(
                        f"trial {number}: pruned at step {pruned} ({o.monitor} {f.reported[-1][1]:.4f})",
                        flush=True,
                    )
                elif status is None:
                    continue
                elif status[0]:
                    value, err = final_value(f.run_dir, o.monitor)
                    if value is None:
                        f.trial.set_user_attr("error", err)
                        study.tell(f.trial, state=TrialState.FAIL)
                        print(f"trial {number}: failed: {err}", flush=True)
                    else:
                        study.tell(f.trial, value)
                        print(
                            f"trial {number}: {o.monitor} {value:.4f} {_params_text(used_params(f.trial))}",
                            flush=True,
                        )
                else:
                    f.trial.set_user_attr("error", status[1])
                    study.tell(f.trial, state=TrialState.FAIL)
                    print(f"trial {number}: failed: {status[1]}", flush=True)
                del flying[number]
                done += 1
    except BaseException:
        # Ctrl-C or a failure: stop the trials (they would run on unattended, and the local trials' fork
        # server waits for them); they stay RUNNING in the study and are re-queued by the next `mariana tune`
        # with the same --out. A cancel that fails (the job service gone) does not hide the first error.
        for f in flying.values():
            with contextlib.suppress(Exception):
                runner.cancel(f.handle)
        raise
    return finish(study, o, name)


def _launch(trial, o: TuneOptions, runner, trials_dir: Path) -> InFlight:
    """Start one asked Optuna ``trial``: its parameters (only those that apply to its values, e.g. no
    --hidden for --model fm) as a ``mariana APP train`` under ``trials_dir/trial-NNNN`` through ``runner``."""
    params = {n: p.suggest(trial) for n, p in o.space.params.items()}
    used = applicable_values(
        o.info.config_cls(), {**o.space.fixed, **params}, o.train_flags, o.info.presets()
    )
    params = {n: v for n, v in params.items() if n in used}
    run_dir = trials_dir / f"trial-{trial.number:04d}"
    if run_dir.exists():  # left by a study whose database was removed: never train over it
        shutil.rmtree(run_dir)
    parent = os.environ.get(PARENT_ENV)  # the study's MLflow run (`start_study`)
    argv = [o.app, "train", *o.train_flags, *flag_args(o.space.fixed), *flag_args(params),
            "--out", str(run_dir.resolve()), *(["--mlflow-parent", parent] if parent else [])]  # fmt: skip
    trial.set_user_attr("params", params)  # what results.json and the tables show: only what applied
    trial.set_user_attr("run_dir", str(run_dir.resolve()))
    trial.set_user_attr("argv", argv)
    handle = runner.start(argv, run_dir.resolve(), f"trial {trial.number}")
    trial.set_user_attr("handle", handle)
    if "job_id" in handle:
        trial.set_user_attr("job_id", handle["job_id"])
    return InFlight(trial, handle, run_dir)


def _report(f: InFlight, monitor: str) -> int | None:
    """Report the trial's new eval records to Optuna; the step at which the pruner stops it, if it does."""
    for rec in read_new_records(f):
        v, step = metric_value(rec, monitor), rec.get("step")
        if v is None or not isinstance(step, int) or not math.isfinite(v):
            continue
        if f.reported and step <= f.reported[-1][0]:
            continue  # a final eval record repeats the last step; Optuna keeps one value per step
        f.trial.report(v, step)
        f.reported.append((step, v))
        if f.trial.should_prune():
            return step
    return None


def _params_text(params: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def best_config(run_dir: Path, config_cls: type) -> dict:
    """The run's ``config.toml`` less what names this run (out, data, paths, config, preset, resume)."""
    values = read_config_values(run_dir / "config.toml")
    drop = set(RESERVED) | {"preset"}
    drop |= {f.name for f in dataclasses.fields(config_cls) if f.metadata.get("path")}
    return {k: v for k, v in values.items() if k not in drop}


def finish(study, o: TuneOptions, name: str) -> int:
    """Results table, results.json, best.toml, best/ and the headline line."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    rows = [trial_row(t) for t in trials]
    print(f"\n{'trial':>5}  {'state':<8}  {o.monitor:>8}  params")
    for r in rows:
        v = f"{r['value']:.4f}" if isinstance(r["value"], float) else "-"
        extra = f"  ({r['error']})" if r["error"] else ""
        print(f"{r['number']:>5}  {r['state']:<8}  {v:>8}  {_params_text(r['params'])}{extra}")
    counts = {s: sum(r["state"] == s for r in rows) for s in ("complete", "pruned", "fail")}
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    summary = {"study": name, "app": o.app, "monitor": o.monitor, "direction": o.direction, "trials": rows}
    if not complete:
        atomic_write_text(o.out / "results.json", json.dumps(summary, indent=1) + "\n")
        print(f"mariana: error: no trial of study {name!r} completed ({counts['pruned']} pruned, "
              f"{counts['fail']} failed); see the table above", file=sys.stderr)  # fmt: skip
        return 1
    best = study.best_trial
    run_dir = Path(best.user_attrs["run_dir"])
    cfg = best_config(run_dir, o.info.config_cls())
    # Paths (e.g. vision's --eval-data) are left out like --data: name them in the retrain line.
    saved = read_config_values(run_dir / "config.toml")
    paths = [f"--{k.replace('_', '-')} {saved[k]}" for k in sorted(set(saved) - set(cfg) - set(RESERVED))
             if k != "preset" and saved[k]]  # fmt: skip
    header = (
        f"# best trial {best.number} of study {name!r}: {o.monitor} = {best.value:.6g}\n"
        f"# retrain: mariana {o.app} train --config {o.out / 'best.toml'} --data DATA --out RUN"
        + "".join(f" {p}" for p in paths)
        + "\n"
    )
    atomic_write_text(o.out / "best.toml", header + sectioned_toml(o.info.config_cls(), cfg))
    tmp = o.out / "best.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(run_dir, tmp, ignore=shutil.ignore_patterns("checkpoints"))
    shutil.rmtree(o.out / "best", ignore_errors=True)
    os.replace(tmp, o.out / "best")
    summary["best"] = {
        "number": best.number,
        "value": best.value,
        "params": used_params(best),
        "run_dir": str(run_dir),
    }
    atomic_write_text(o.out / "results.json", json.dumps(summary, indent=1) + "\n")
    print(
        f"best trial {best.number}: {o.monitor} {best.value:.4f} ({counts['complete']} complete, "
        f"{counts['pruned']} pruned, {counts['fail']} failed) -> {o.out / 'best'}"
    )
    return 0
