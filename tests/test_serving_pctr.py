"""`mariana serve --pctr`: a real uvicorn server answers the same click probabilities as the offline
`mariana pctr eval` model, reports invalid instances one by one, and exposes health, metrics and docs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from mariana.apps.pctr.data.encoding import ReadStats, iter_chunks
from mariana.apps.pctr.models.predict import load_predictor
from mariana.platform.core.evaluator import auc_logloss
from mariana.platform.core.rundir import eval_result_path
from test_serving_helpers import CRITEO, FRAPPE, head_lines, parse_prometheus, pctr_probs, serve, strip_label
from trained_runs import cli_here, fresh_copy

N_LIBFM = 3000  # Frappe rows compared (the whole Criteo sample, 999 rows, is compared)


@pytest.fixture(scope="module")
def runs(frappe_deepfm, criteo_dcn, tmp_path_factory):
    """Copies of the shared runs: `pctr eval` writes its results into the run."""
    d = tmp_path_factory.mktemp("served")
    return {"libfm": fresh_copy(frappe_deepfm, d / "libfm"), "criteo": fresh_copy(criteo_dcn, d / "criteo")}


@pytest.fixture(scope="module")
def server(runs, tmp_path_factory):
    s = serve(["--pctr", runs["libfm"]], tmp_path_factory)
    yield s
    s.stop()


def _offline(run, data) -> tuple[np.ndarray, np.ndarray, dict]:
    """(labels, probabilities) of the eval code path for every valid row of ``data``, and the
    `mariana pctr eval` result (the real command, whose AUC/logloss come from those probabilities)."""
    proc = cli_here(["pctr", "eval", "--model", run, "--data", data], check=True)
    assert proc.stdout.strip().splitlines()[-1].startswith("AUC "), proc.stdout
    result = json.loads(eval_result_path(run, data).read_text())
    pred = load_predictor(run)
    stats = ReadStats()
    labels, probs = [], []
    for chunk in iter_chunks(data, pred.encoder, stats=stats):
        labels.append(chunk.labels.numpy())
        probs.append(pred.predict(chunk))
    assert stats.skipped == result["skipped"] == 0
    return np.concatenate(labels), np.concatenate(probs), result


@pytest.mark.parametrize("fmt", ["libfm", "criteo"])
def test_served_probabilities_equal_offline_eval(fmt, runs, server, tmp_path, tmp_path_factory):
    run = runs[fmt]
    if fmt == "libfm":
        data = tmp_path / "frappe-head.libfm"
        data.write_text("\n".join(head_lines(FRAPPE, N_LIBFM)) + "\n")
        srv = server
    else:
        data = CRITEO
        srv = serve(["--pctr", run], tmp_path_factory)
    try:
        labels, offline, result = _offline(run, data)
        lines = [strip_label(ln, fmt) for ln in head_lines(data, 10**6)]
        assert len(lines) == len(offline)
        served: list = []
        for i in range(0, len(lines), 700):  # several batch requests ...
            served += pctr_probs(srv.predict(lines[i : i + 700]))
        for i in range(0, 40):  # ... and single-instance requests (micro-batched together or not)
            assert pctr_probs(srv.predict([lines[i]])) == pytest.approx([served[i]], abs=1e-6)
        served = np.asarray(served, dtype=np.float64)
        np.testing.assert_allclose(served, offline, rtol=0, atol=1e-6)
        m = auc_logloss(labels, served)
        assert m["auc"] == pytest.approx(result["auc"], abs=1e-6)
        assert m["logloss"] == pytest.approx(result["logloss"], abs=1e-6)
        # The version that answered is the exported model's.
        body = srv.predict(lines[:1]).json()
        assert body["model_version"] == load_predictor(run).version
    finally:
        if srv is not server:
            srv.stop()


def test_structured_json_and_per_instance_errors(runs, server):
    line = strip_label(head_lines(FRAPPE, 1)[0], "libfm")
    feats = [[int(t.split(":")[0]), float(t.split(":")[1])] for t in line.split()]
    good = pctr_probs(server.predict([line]))[0]
    r = server.predict(
        [
            line,
            "not a record",
            {"features": feats},
            {"features": {str(k): v for k, v in feats}},
            {"features": "oops"},
            "1:nan 2:1",
            "",
        ]
    )
    assert r.status_code == 200, r.text
    body = r.json()
    probs = body["probabilities"]
    assert probs[0] == pytest.approx(good, abs=1e-6)
    assert probs[2] == pytest.approx(good, abs=1e-6) and probs[3] == pytest.approx(good, abs=1e-6)
    assert [p is None for p in probs] == [False, True, False, False, True, True, True]
    errs = {e["index"]: e["error"] for e in body["errors"]}
    assert set(errs) == {1, 4, 5, 6} and all(isinstance(v, str) and v for v in errs.values())
    # A request whose every instance is invalid is a 422 that still lists each instance's error.
    r = server.predict(["x", "y:z"])
    assert r.status_code == 422 and len(r.json()["errors"]) == 2 and "error" in r.json()


def test_health_metrics_docs(server):
    h = server.client.get("/healthz").json()
    assert h["status"] == "ok" and h["models"]["pctr"]["version"]
    server.predict(["1:1"])
    server.client.post("/v1/pctr/predict", json={"instances": 3})
    samples = parse_prometheus(server.client.get("/metrics").text)
    assert samples['mariana_http_requests_total{route="/v1/pctr/predict",status="200"}'] >= 1
    assert samples['mariana_http_requests_total{route="/v1/pctr/predict",status="422"}'] >= 1
    assert samples['mariana_http_request_duration_seconds_count{route="/v1/pctr/predict"}'] >= 2
    assert samples['mariana_batch_size_bucket{app="pctr",le="+Inf"}'] >= 1
    assert 'mariana_queue_depth{app="pctr"}' in samples
    version = h["models"]["pctr"]["version"]
    assert any(k.startswith("mariana_model_info{") and f'version="{version}"' in k for k in samples)
    assert server.client.get("/docs").status_code == 200
    spec = server.client.get("/openapi.json").json()
    assert "/v1/pctr/predict" in spec["paths"] and "/v1/admin/reload" in spec["paths"]
    # Apps not given on the command line: their routes answer a JSON 404 naming the missing flag.
    r = server.client.post("/v1/asr/transcribe", files={"file": ("a.wav", b"RIFF....WAVE", "audio/wav")})
    assert r.status_code == 404 and "--asr" in r.json()["error"]
