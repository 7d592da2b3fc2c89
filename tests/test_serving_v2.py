"""`mariana serve` speaks the Open Inference Protocol (KServe v2): NVIDIA's ``tritonclient`` (a client we did
not write), against a real uvicorn server process serving pCTR, vision and ASR models, gets the answers of
the ``/v1`` routes in both encodings (JSON tensors, and Triton's binary tensor data extension); metadata,
health, tokens and protocol errors; the Prometheus exposition read with ``prometheus_client``'s parser."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from helpers import DATA
from prometheus_client.parser import text_string_to_metric_families
from test_serving_helpers import FRAPPE, head_lines, pctr_probs, serve, strip_label
from trained_runs import fresh_copy, train
from tritonclient.utils import InferenceServerException

CIFAR = DATA / "cifar10" / "test-dev.tar"
FSDD = DATA / "fsdd" / "recordings"
TOKEN = "v2-secret"
STEPS = ["--max-steps", "3", "--no-progress"]


def _asr_run(d):
    fsdd = d / "fsdd"
    fsdd.mkdir()
    for spk in ("george", "jackson"):
        for digit in range(10):
            (fsdd / f"{digit}_{spk}_0.wav").symlink_to(FSDD / f"{digit}_{spk}_0.wav")
    prep = ["asr", "prepare", "--data", fsdd, "--test-speakers", "jackson", "--utterances", "8"]
    data = train([*prep, "--max-digits", "2"], d / "data").path
    return train(["asr", "train", "--data", data, "--preset", "debug", *STEPS], d / "asr").path


@pytest.fixture(scope="module")
def server(frappe_fm, frappe_deepfm, tmp_path_factory):
    """pCTR (a copy of the shared Frappe FM; the DeepFM beside it to reload), vision and ASR (3 debug steps
    each), with a bearer token."""
    d = tmp_path_factory.mktemp("v2")
    fresh_copy(frappe_deepfm, d / "deepfm")
    vision = train(
        ["vision", "train", "--data", CIFAR, "--preset", "debug", "--limit", "64", *STEPS], d / "vis"
    )
    (d / "token").write_text(TOKEN + "\n")
    args = [
        "--pctr",
        fresh_copy(frappe_fm, d / "fm"),
        "--vision",
        vision.path,
        "--asr",
        _asr_run(d),
        "--token-file",
        d / "token",
    ]
    s = serve(args, tmp_path_factory)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    c = triton.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=120)
    yield c
    c.close()


def images(n: int) -> list[bytes]:
    out = []
    with tarfile.open(CIFAR) as t:
        for m in t:
            if m.isfile() and len(out) < n:
                out.append(t.extractfile(m).read())
    return out


def infer(client, model: str, name: str, items: list[bytes], binary: bool, outputs: list[str], **kw):
    """One BYTES input; the inputs travel binary when they must (media is not UTF-8) or ``binary`` says."""
    arr = np.array(items, dtype=np.object_)
    inp = triton.InferInput(name, [len(items)], "BYTES")
    inp.set_data_from_numpy(arr, binary_data=binary or model != "pctr")
    outs = [triton.InferRequestedOutput(o, binary_data=binary) for o in outputs]
    return client.infer(model, [inp], outputs=outs, **kw)


def version(server, app: str) -> str:
    return server.client.get("/healthz").json()["models"][app]["version"]


@pytest.mark.parametrize("binary", [True, False])
def test_pctr_v2_equals_v1(server, client, binary):
    lines = [strip_label(x, "libfm") for x in head_lines(FRAPPE, 40)]
    want = np.array(pctr_probs(server.predict(lines)), dtype=np.float32)
    res = infer(client, "pctr", "lines", [x.encode() for x in lines], binary, ["probabilities"])
    got = res.as_numpy("probabilities")
    assert got.dtype == np.float32 and got.shape == (40,)
    np.testing.assert_array_equal(got, want)
    assert res.get_response()["model_version"] == version(server, "pctr")
    # Outputs not named: all of them, binary (tritonclient asks binary_data_output).
    inp = triton.InferInput("lines", [2], "BYTES")
    inp.set_data_from_numpy(np.array([x.encode() for x in lines[:2]], dtype=np.object_), binary_data=binary)
    np.testing.assert_array_equal(client.infer("pctr", [inp]).as_numpy("probabilities"), want[:2])


@pytest.mark.parametrize("binary", [True, False])
def test_vision_v2_equals_v1(server, client, binary):
    imgs = images(2)
    res = infer(client, "vision", "image", imgs, binary, ["labels", "probabilities"], parameters={"k": 3})
    labels, probs = res.as_numpy("labels"), res.as_numpy("probabilities")
    assert labels.shape == probs.shape == (2, 3) and probs.dtype == np.float32
    for i, img in enumerate(imgs):
        r = server.client.post("/v1/vision/classify?k=3", files={"file": ("a.jpg", img, "image/jpeg")})
        assert r.status_code == 200, r.text
        want = r.json()["labels"]
        got_labels = [x.decode() if isinstance(x, bytes) else x for x in labels[i]]
        assert got_labels == [x["label"] for x in want]
        np.testing.assert_array_equal(probs[i], np.float32([x["probability"] for x in want]))


@pytest.mark.parametrize("binary", [True, False])
def test_asr_v2_equals_v1(server, client, binary):
    wavs = [(FSDD / f"{d}_jackson_1.wav").read_bytes() for d in (3, 7)]
    got = infer(client, "asr", "audio", wavs, binary, ["transcript"]).as_numpy("transcript")
    assert got.shape == (2,)
    for wav, text in zip(wavs, got):
        r = server.client.post("/v1/asr/transcribe", files={"file": ("a.wav", wav, "audio/wav")})
        assert r.status_code == 200, r.text
        assert (text.decode() if isinstance(text, bytes) else text) == r.json()["transcript"]


def test_metadata_health_and_readiness(server, client):
    assert client.is_server_live() and client.is_server_ready()
    assert all(client.is_model_ready(m) for m in ("pctr", "vision", "asr"))
    assert not client.is_model_ready("mlp")  # an app without Open Inference routes: 404
    meta = client.get_model_metadata("pctr")
    assert meta["inputs"] == [{"name": "lines", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1]}]
    assert meta["versions"] == [version(server, "pctr")]
    vis = client.get_model_metadata("vision")
    assert [(t["name"], t["datatype"], t["shape"]) for t in vis["outputs"]] == [
        ("labels", "BYTES", [-1, -1]),
        ("probabilities", "FP32", [-1, -1]),
    ]
    assert client.get_model_metadata("asr")["outputs"][0]["name"] == "transcript"
    assert server.client.get("/health").json()["status"] == "ok"


def test_protocol_errors_are_kserve_json(server, client):
    url = "/v2/models/pctr/infer"
    cases = [
        (
            {"inputs": [{"name": "rows", "datatype": "BYTES", "shape": [1], "data": ["1:1"]}]},
            "expected {'lines': 'BYTES'}",
        ),
        (
            {"inputs": [{"name": "lines", "datatype": "BYTES", "shape": [2], "data": ["1:1"]}]},
            "needs 2 elements, the data has 1",
        ),
        ({"inputs": [{"name": "lines", "datatype": "BYTES", "shape": [1], "data": ["x:y"]}]}, "lines[0]"),
        ({"inputs": "lines"}, '"inputs" list'),
        ({"inputs": [{"name": "lines", "datatype": "FP32", "shape": [1], "data": [1.0]}]}, "'lines': 'FP32'"),
        (
            {"inputs": [{"name": "lines", "datatype": "BYTES", "shape": ["1"], "data": ["1:1"]}]},
            "shape of counts",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "lines",
                        "datatype": "BYTES",
                        "shape": [1],
                        "parameters": {"binary_data_size": 9},
                    }
                ]
            },
            "runs past the body's end",
        ),
    ]
    for body, words in cases:
        r = server.client.post(url, json=body)
        assert r.status_code == 400 and words in r.json()["error"], (body, r.text)
    r = server.client.post(url, content=b"{}", headers={"Inference-Header-Content-Length": "99"})
    assert r.status_code == 400 and "Inference-Header-Content-Length" in r.json()["error"]
    r = server.client.post("/v2/models/nope/infer", json={"inputs": []})
    assert r.status_code == 404 and "nope" in r.json()["error"]
    with pytest.raises(InferenceServerException, match="not a JPEG"):
        infer(client, "vision", "image", [b"not an image"], True, ["labels"])


def test_token_needed_from_another_host(server, client):
    """Through a proxy (uvicorn trusts X-Forwarded-For from loopback) a request is another host's."""
    lines = [strip_label(head_lines(FRAPPE, 1)[0], "libfm").encode()]
    with pytest.raises(InferenceServerException, match="bearer token"):
        infer(
            client,
            "pctr",
            "lines",
            lines,
            True,
            ["probabilities"],
            headers={"X-Forwarded-For": "198.51.100.7"},
        )
    hdr = {"X-Forwarded-For": "198.51.100.7", "Authorization": f"Bearer {TOKEN}"}
    assert infer(client, "pctr", "lines", lines, True, ["probabilities"], headers=hdr).as_numpy(
        "probabilities"
    ).shape == (1,)


def test_metrics_parse_with_prometheus_client(server, client):
    infer(
        client,
        "pctr",
        "lines",
        [strip_label(x, "libfm").encode() for x in head_lines(FRAPPE, 2)],
        True,
        ["probabilities"],
    )
    text = server.client.get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert {"mariana_http_requests", "mariana_http_request_duration_seconds", "mariana_batch_size"} <= set(
        fams
    )
    assert {"mariana_queue_depth", "mariana_instances", "mariana_model_info", "mariana_model_reloads"} <= set(
        fams
    )

    def value(family: str, sample: str, **labels) -> float:
        found = [
            s.value for s in fams[family].samples if s.name == sample and labels.items() <= s.labels.items()
        ]
        assert len(found) == 1, (sample, labels, fams[family].samples)
        return found[0]

    route = "/v2/models/{name}/infer"
    assert value("mariana_http_requests", "mariana_http_requests_total", route=route, status="200") >= 1
    assert (
        value(
            "mariana_http_request_duration_seconds",
            "mariana_http_request_duration_seconds_count",
            route=route,
        )
        >= 1
    )
    # v2 instances go through /v1's micro-batcher and counters
    assert value("mariana_instances", "mariana_instances_total", app="pctr", result="ok") >= 2
    assert value("mariana_batch_size", "mariana_batch_size_bucket", app="pctr", le="+Inf") >= 1
    assert value("mariana_queue_depth", "mariana_queue_depth", app="pctr") == 0
    for app in ("pctr", "vision", "asr"):
        assert value("mariana_model_info", "mariana_model_info", app=app, version=version(server, app)) == 1
    assert "_created" not in text
    r = httpx.get(server.url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert json.loads(server.client.get("/v2").text)["extensions"] == ["binary_tensor_data"]


def test_reload_switches_the_v2_answers_too(server, client):
    lines = [strip_label(x, "libfm") for x in head_lines(FRAPPE, 5)]
    before = infer(client, "pctr", "lines", [x.encode() for x in lines], True, ["probabilities"])
    auth = {"Authorization": f"Bearer {TOKEN}"}
    fm = before.get_response()["model_version"]
    for run in ("deepfm", "fm"):
        run_dir = str(Path(server.client.get("/healthz").json()["models"]["pctr"]["run_dir"]).parent / run)
        r = server.client.post("/v1/admin/reload", json={"app": "pctr", "run_dir": run_dir}, headers=auth)
        assert r.status_code == 200, r.text
        res = infer(client, "pctr", "lines", [x.encode() for x in lines], False, ["probabilities"])
        want = np.array(pctr_probs(server.predict(lines)), dtype=np.float32)
        np.testing.assert_array_equal(res.as_numpy("probabilities"), want)
        assert (
            res.get_response()["model_version"]
            == version(server, "pctr")
            == client.get_model_metadata("pctr")["versions"][0]
        )
        assert (res.get_response()["model_version"] == fm) == (run == "fm")
