"""Experiment tracking (`platform/core/tracking.py`, issue 44 point 1) against the real things: an
``mlflow server`` process started once for this module (SQLite backend store, artifacts proxied by the
server) read back with ``MlflowClient``, and TensorBoard event files read back with TensorBoard's own
``EventAccumulator``. Commands run in this process (`jobs_helpers.run_in_process`), a tune's trials as
processes of their own or as jobs of a real job service (their parent run id reaches them as
``--mlflow-parent`` on their command line).

The server's start takes 10-50 s on a loaded 2-core machine (measured, printed with -s): one per module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import httpx
import pytest
from helpers import DATA, ROOT, free_port, last_line
from jobs_helpers import Service, run_in_process

mlflow = pytest.importorskip("mlflow", reason="the tracking extra: pip install mariana[tracking]")
pytest.importorskip("tensorboard")

from mariana.apps.mlp.configs import MlpConfig  # noqa: E402
from mariana.platform.core import tracking  # noqa: E402
from mariana.platform.core.rundir import RunDir  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

FRAPPE = DATA / "frappe" / "frappe.validation.libfm"


@pytest.fixture(autouse=True)
def _environ_put_back():
    """A tracker opened in this process sets MLflow's settings in os.environ (as it may in its own CLI
    process): put back after each test, or every later command of this pytest process would see them (and
    run in a fresh interpreter: its environment no longer fits the zygote's)."""
    with mock.patch.dict(os.environ):
        yield


TRAIN = ["--preset", "debug", "--max-steps", "6", "--log-every", "2"]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> str:
    """A real MLflow tracking server on 127.0.0.1 -> its URI."""
    root, port = tmp_path_factory.mktemp("mlflow"), free_port()
    cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri",
           f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts"),
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]  # fmt: skip
    t0 = time.monotonic()
    # MLflow's server-side job runner (a huey consumer and its workers: processes of their own) serves its
    # GenAI jobs, which tracking does not use: off, it takes no CPU from the training the tests time.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(root / "server.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, env=env)
    uri = f"http://127.0.0.1:{port}"
    try:
        while time.monotonic() - t0 < 240:
            assert proc.poll() is None, (root / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{uri}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        else:
            raise AssertionError("mlflow server did not answer in 240 s")
        print(f"\nmlflow server answered after {time.monotonic() - t0:.1f} s")
        yield uri
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def frappe_slice(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "frappe.libfm"
    with open(FRAPPE) as src:
        path.write_text("".join(line for _, line in zip(range(3000), src)))
    return path


def _records(run: Path, field: str) -> list[tuple[int, float]]:
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[field]) for r in lines if field in r]


@pytest.mark.slow  # the mlflow server process (and training, trial processes)
def test_training_run_logs_params_metrics_tags_model_and_event_files(
    server, frappe_slice, tmp_path, capsys, monkeypatch
):
    run, board = tmp_path / "run", tmp_path / "tb"
    argv = ["mlp", "train", *TRAIN, "--data", frappe_slice, "--out", run, "--tensorboard", board]
    monkeypatch.setattr(sys, "argv", ["mariana", *map(str, argv)])  # what a `mariana` process has
    proc = run_in_process(argv, capsys, {"MLFLOW_TRACKING_URI": server}, check=True)
    assert "validation AUC" in last_line(proc.stdout)  # the headline stays last (no MLflow URL lines)
    record = json.loads((run / "tracking.json").read_text())
    assert record["mlflow"]["uri"] == server and record["tensorboard"] == str(board / "run")
    client = MlflowClient(server)
    got = client.get_run(record["mlflow"]["run_id"])
    assert record["mlflow"]["url"].endswith(f"/runs/{got.info.run_id}") and got.info.status == "FINISHED"
    params = got.data.params
    assert params["run.out"] == str(run) and params["loop.max_steps"] == "6" and params["net.hidden"]
    assert len(params) > 30  # every field of the config, as section.field
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    assert {k: got.data.tags[k] for k in ("app", "command", "commit")} == {
        "app": "mlp",
        "command": "train",
        "commit": commit.strip(),
    }
    loss = _records(run, "loss")
    assert [s for s, _ in loss] == [2, 4, 6]
    history = client.get_metric_history(got.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == pytest.approx(loss)
    assert [
        (m.step, m.value) for m in client.get_metric_history(got.info.run_id, "eval_auc")
    ] == pytest.approx(_records(run, "eval_auc"))
    final = json.loads((run / "metrics.json").read_text())
    assert got.data.metrics["final.train_loss"] == pytest.approx(final["train_loss"])
    files = {a.path for a in client.list_artifacts(got.info.run_id, "model")}
    assert files == {"model/model.safetensors", "model/model.json"}

    events = EventAccumulator(str(board / "run"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == pytest.approx(loss)
    assert [e.step for e in events.Scalars("eval_auc")] == [s for s, _ in _records(run, "eval_auc")]


@pytest.mark.slow  # the mlflow server process (and training, trial processes)
def test_params_are_cut_to_mlflow_limits_and_sent_in_batches(server, monkeypatch):
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

    sizes, real = [], MlflowClient.log_batch  # the batches as sent (this server takes larger ones too)

    def spy(self, run_id, metrics=(), params=(), **kw):
        sizes.append(len(params))
        return real(self, run_id, metrics=metrics, params=params, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", spy)
    params = {f"s.p{i:03d}": str(i) for i in range(250)}  # more than one log_batch may carry (100)
    params["s.long"] = "x" * (MAX_PARAM_VAL_LENGTH + 500)
    sink = tracking.MlflowSink(server, {"app": "unit"}, params)
    got = MlflowClient(server).get_run(sink.run.run_id).data.params
    assert len(got) == 251 and got["s.p249"] == "249"
    assert got["s.long"] == "x" * MAX_PARAM_VAL_LENGTH
    assert sum(sizes) == 251 and max(sizes) <= MAX_PARAMS_TAGS_PER_BATCH, sizes


def test_tracker_down_costs_one_warning_not_the_run(frappe_slice, tmp_path, capsys):
    run, closed = tmp_path / "run", f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = run_in_process(["mlp", "train", *TRAIN, "--data", frappe_slice, "--out", run], capsys,
                          {"MLFLOW_TRACKING_URI": closed}, check=True)  # fmt: skip
    assert "validation AUC" in last_line(proc.stdout)
    warned = [ln for ln in (run / "logs" / "rank-0.log").read_text().splitlines() if "WARNING" in ln]
    assert len(warned) == 1 and "mlflow tracking is off" in warned[0], warned
    assert (run / "metrics.json").is_file() and (run / "model.safetensors").is_file()


def test_only_the_main_rank_tracks(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    cfg = MlpConfig(tensorboard=str(tmp_path / "tb"))
    run = RunDir(tmp_path / "run")
    tracking.attach(cfg, run, SimpleNamespace(is_main=False))  # ranks > 0 (and parameter servers)
    assert run.tracker is None and not (tmp_path / "tb").exists()
    assert not (run.path / tracking.RECORD).exists()


SPACE = """
[params.lr]
type = "float"
low = 1e-3
high = 1e-2

[fixed]
max_steps = 6
eval_every = 3
"""


@pytest.mark.slow  # the mlflow server process (and training, trial processes)
@pytest.mark.parametrize("runner", ["local", "jobs"])
def test_tune_study_is_the_parent_of_its_trial_processes(
    server, frappe_slice, tmp_path, capsys, monkeypatch, runner
):
    """Trials as local processes and as jobs of a real job service (whose environment the tune process
    does not share: the parent id travels in each trial's command line as --mlflow-parent)."""
    space, out = tmp_path / "space.toml", tmp_path / "tune"
    space.write_text(SPACE)
    argv = ["tune", "pctr", "--space", space, "--trials", "2", "--parallel", "2", "--out", out,
            "--preset", "debug", "--data", frappe_slice]  # fmt: skip
    env = {"MLFLOW_TRACKING_URI": server}
    if runner == "local":
        argv.append("--local")
    else:  # the service's jobs log to MLflow through the service's own environment
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
        svc = Service(tmp_path / "home")
        env["MARIANA_JOBS_URL"] = svc.url
    try:
        proc = run_in_process(argv, capsys, env, check=True)
    finally:
        svc.stop() if runner == "jobs" else None
    assert last_line(proc.stdout).startswith("best trial ")
    parent = json.loads((out / "tracking.json").read_text())["mlflow"]["run_id"]
    client = MlflowClient(server)
    got = client.get_run(parent)
    assert got.data.tags["command"] == "tune" and got.data.tags["app"] == "pctr"
    assert got.data.params["tune.trials"] == "2"
    children = client.search_runs([got.info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert len(children) == 2
    for child in children:
        assert (child.data.tags["app"], child.data.tags["command"]) == ("pctr", "train")
        assert child.info.status == "FINISHED" and "eval_auc" in child.data.metrics
        assert child.data.params["run.out"].startswith(str(out))


def test_mlflow_parent_needs_a_tracking_uri(capsys, tmp_path):
    """--mlflow-parent without MLFLOW_TRACKING_URI changes nothing: refused in one line, exit 2."""
    argv = ["mlp", "train", "--data", FRAPPE, "--out", tmp_path / "run", *TRAIN, "--mlflow-parent", "abc"]
    proc = run_in_process(argv, capsys, {"MLFLOW_TRACKING_URI": ""})
    assert proc.returncode == 2 and "--mlflow-parent applies to MLflow tracking only" in proc.stderr
    assert not (tmp_path / "run").exists()
