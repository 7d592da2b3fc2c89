"""Experiment tracking, optional (``pip install mariana[tracking]``): MLflow when ``MLFLOW_TRACKING_URI`` is
set (MLflow's convention), TensorBoard event files with ``--tensorboard DIR`` (in ``DIR/<run dir name>``).
`attach` gives rank 0's `RunDir` a `Tracker`: params ``section.field``, tags app/command/commit, every
``metrics.jsonl`` record, the final metrics, the exported ``RUN/model.*`` (artifact folder ``model``), all
recorded in ``RUN/tracking.json``. A failing tracker costs one warning and is dropped, never the run."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from . import jsonfile
from .atomic import atomic_write_text
from .config import Section, opt
from .errors import MarianaError

log = logging.getLogger("mariana")
PARENT_ENV = "MARIANA_MLFLOW_PARENT"  # a tune study's MLflow run id, given to its trials as --mlflow-parent
RECORD = "tracking.json"  # {"mlflow": {uri, run_id, experiment_id, url}, "tensorboard": folder}
HERE = Path(__file__).parent


@dataclass
class TrackingSection(Section):
    """Where a training run's metrics go besides ``metrics.jsonl``."""

    NAME: ClassVar[str] = "tracking"
    TITLE: ClassVar[str] = "experiment tracking (MLflow: set MLFLOW_TRACKING_URI)"

    tensorboard: str = opt("", "write TensorBoard event files to DIR/<run dir name>", path=True)
    mlflow_parent: str = opt(
        "", "nest the MLflow run under run ID (mariana tune gives its trials the study's)"
    )

    def validate(self) -> None:
        if self.mlflow_parent and not os.environ.get("MLFLOW_TRACKING_URI"):
            raise MarianaError("--mlflow-parent applies to MLflow tracking only: set MLFLOW_TRACKING_URI")


def source_commit() -> str:
    """The git commit of the running sources ('unknown' outside a checkout)."""
    with contextlib.suppress(OSError):
        git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout
        return git.strip() or "unknown"
    return "unknown"


def _open(name: str, make: Callable[[], Any]) -> dict[str, Any]:
    """``{name: make()}``, or {} after one warning: whatever an optional tracker raises, training goes on."""
    try:
        return {name: make()}
    except Exception as e:  # noqa: BLE001
        text = str(e).splitlines()[0][:200] if str(e) else ""
        log.warning("%s tracking is off for this run (%s: %s)", name, type(e).__name__, text)
        return {}


class MlflowSink:
    """A new MLflow run at ``uri`` (experiment: MLFLOW_EXPERIMENT_NAME, made when missing, else Default)."""

    def __init__(self, uri: str, tags: dict[str, str], params: dict[str, str]):
        # a tracker that is down costs seconds, not MLflow's minutes of retries; stdout ends in the headline
        for k, v in (("HTTP_REQUEST_MAX_RETRIES", "0"), ("SUPPRESS_PRINTING_URL_TO_STDOUT", "true")):
            os.environ.setdefault(f"MLFLOW_{k}", v)
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        self.client, self.Metric = MlflowClient(uri), Metric
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "")
        found = self.client.get_experiment_by_name(name) if name else None
        exp = found.experiment_id if found else self.client.create_experiment(name) if name else "0"
        self.run = self.client.create_run(exp, tags=tags, run_name=tags.get("mlflow.runName")).info
        entries = [Param(k, v[:MAX_PARAM_VAL_LENGTH]) for k, v in params.items()]
        for i in range(0, len(entries), MAX_PARAMS_TAGS_PER_BATCH):  # the server refuses larger batches
            self.client.log_batch(self.run.run_id, params=entries[i : i + MAX_PARAMS_TAGS_PER_BATCH])
        page = f"{uri.rstrip('/')}/#/experiments/{exp}/runs/{self.run.run_id}"
        self.record = {"uri": uri, "run_id": self.run.run_id, "experiment_id": exp,
                       "url": page if uri.startswith(("http://", "https://")) else ""}  # fmt: skip

    def scalars(self, values: dict[str, float], step: int, wall: float) -> None:
        metrics = [self.Metric(k, v, int(wall * 1000), step) for k, v in values.items()]  # < 1000 a batch
        self.client.log_batch(self.run.run_id, metrics=metrics)

    def finish(self, model_files: list[Path]) -> None:
        for f in model_files:
            self.client.log_artifact(self.run.run_id, str(f), "model")
        self.client.set_terminated(self.run.run_id, "FINISHED")


class TensorBoardSink:
    """Event files in ``folder``, written by TensorBoard's writer (through torch's `SummaryWriter`)."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.record, self.writer = str(folder), SummaryWriter(str(folder), flush_secs=10)

    def scalars(self, values: dict[str, float], step: int, wall: float) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step, walltime=wall)

    def finish(self, model_files: list[Path]) -> None:
        self.writer.flush()


class Tracker:
    """Rank 0's sinks of a run (``{name: sink}``, recorded in ``folder/tracking.json``); a failed one goes."""

    def __init__(self, folder: Path, sinks: dict[str, Any]):
        self.folder, self.sinks = folder, sinks
        if sinks:
            folder.mkdir(parents=True, exist_ok=True)
            record = {name: sink.record for name, sink in sinks.items()}
            atomic_write_text(folder / RECORD, jsonfile.dumps(record, indent=2) + "\n")

    def _each(self, what: str, *args: Any) -> None:
        for name, sink in list(self.sinks.items()):
            if not _open(name, lambda call=getattr(sink, what): call(*args)):
                del self.sinks[name]

    def log(self, record: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` record: each numeric field a point at the record's ``step``."""
        numbers = {k: v for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        values = {k: float(v) for k, v in numbers.items() if k not in ("step", "time")}
        if values and "step" in record:
            self._each("scalars", values, int(record["step"]), record.get("time", time.time()))

    def final(self, metrics: dict[str, Any]) -> None:
        """``metrics.json``'s values (as ``final.<name>``), then the exported model files; ends the run."""
        self.log({"step": int(metrics.get("steps", 0)), **{f"final.{k}": v for k, v in metrics.items()}})
        self._each("finish", sorted(self.folder.glob("model.*")))


def open_tracker(folder: Path, tags: dict[str, str], params: dict[str, str], board: str = "") -> Tracker:
    """The `Tracker` of a run in ``folder``: MLflow when ``MLFLOW_TRACKING_URI`` is set, TensorBoard with a
    ``board`` folder (events in ``board/<folder name>``); tags ``commit`` and ``mlflow.runName`` added."""
    uri, tags = os.environ.get("MLFLOW_TRACKING_URI", ""), {"commit": source_commit(), **tags}
    tags = {"mlflow.runName": folder.name, **{k: v for k, v in tags.items() if v}}
    sinks = _open("mlflow", lambda: MlflowSink(uri, tags, params)) if uri else {}
    sinks.update(_open("tensorboard", lambda: TensorBoardSink(Path(board) / folder.name)) if board else {})
    return Tracker(folder, sinks)


def attach(cfg: Any, run, ctx) -> None:
    """Give ``run`` (a `RunDir`) its `Tracker` on the main rank when MLflow or TensorBoard is asked for
    (once per run directory: a stream's trainers share it); params: each config field as ``section.field``."""
    board, uri = getattr(cfg, "tensorboard", ""), os.environ.get("MLFLOW_TRACKING_URI")
    if not (ctx.is_main and getattr(run, "tracker", None) is None and (uri or board)):
        return
    of = getattr(type(cfg), "SECTION_OF", {})
    params = {f"{of.get(k, 'config')}.{k}": str(v) for k, v in dataclasses.asdict(cfg).items()}
    app, command = ([a for a in sys.argv[1:] if not a.startswith("-")] + ["", ""])[:2]  # `mariana APP CMD`
    tags = {"app": app, "command": command, "mlflow.parentRunId": getattr(cfg, "mlflow_parent", "")}
    run.tracker = open_tracker(run.path, tags, params, board)


def start_study(app: str, out: Path, params: dict[str, str]) -> Tracker:
    """A tune study as the MLflow parent run of its trials: its id, in ``MARIANA_MLFLOW_PARENT`` of this
    process's environment, reaches each trial's command line as ``--mlflow-parent`` (local, job-service and
    Slurm trials alike); ``final({...})`` ends it."""
    tracker = open_tracker(out.resolve(), {"app": app, "command": "tune"}, params)
    if tracker.sinks:
        os.environ[PARENT_ENV] = tracker.sinks["mlflow"].run.run_id
    return tracker
