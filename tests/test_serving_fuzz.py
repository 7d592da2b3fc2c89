"""Malformed requests against a real `mariana serve` server: hand-written cases plus property-based ones
generated (hypothesis) from the server's own OpenAPI schema and mutations of it. Never a 5xx; every
client error is a JSON body ``{"error": ...}``; the server stays alive."""

from __future__ import annotations

import json
import socket
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mariana.apps.asr.features import FeatureSettings, fbank, load_audio
from test_serving_helpers import FRAPPE, head_lines, serve, strip_label
from trained_runs import train

JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30)
ANY_JSON = st.recursive(
    JSON_SCALARS,
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=10), c, max_size=5),
    max_leaves=25,
)


def _asr_run(d: Path) -> Path:
    """An untrained ASR model exported as `mariana asr train` exports it (the upload path only needs one)."""
    import dataclasses

    import torch
    from mariana.apps.asr.cmvn import FilePrior
    from mariana.apps.asr.configs import PRESETS
    from mariana.apps.asr.model import build_model
    from mariana.apps.asr.train import BLANK
    from mariana.platform.core.export import export_model

    cfg = dataclasses.asdict(PRESETS["debug"])
    vocab = [BLANK, "one", "two"]
    torch.manual_seed(0)
    model = build_model(cfg, len(vocab))
    feats = fbank(load_audio(_wav(d / "prior.wav"), FeatureSettings()), FeatureSettings()).numpy()
    s1, s2 = feats.astype(np.float64).sum(0), (feats.astype(np.float64) ** 2).sum(0)
    prior = FilePrior.from_speaker_stats({"s": {"sum": s1, "sumsq": s2, "frames": len(feats)}})
    extra = {"vocab": vocab, "cmvn_prior": prior.to_dict()}
    export_model(d / "asr-run", model.state_dict(), app="asr", arch="dnn-ctc", config=cfg, extra=extra)
    return d / "asr-run"


def _wav(path: Path, samples: int = 4000) -> Path:
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(8000)
        f.writeframes((np.random.default_rng(0).standard_normal(samples) * 3000).astype("<i2").tobytes())
    return path


def _vision_run(d: Path) -> Path:
    """A vision CNN trained for one step on 8 random 32x32 images (2 classes)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (d / "imgs" / c).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(
                d / "imgs" / c / f"{i}.jpg"
            )
    args = ["vision", "train", "--data", d / "imgs", "--preset", "debug"]
    p = train(
        [*args, "--limit", "0", "--max-steps", "1", "--batch-size", "4", "--no-progress"], d / "vision-run"
    )
    assert "final {" not in p.stdout + p.stderr  # no raw JSON dump on the console (issue 30)
    return p.path


@pytest.fixture(scope="module")
def server(frappe_deepfm, tmp_path_factory):
    """Serves all three apps, so the upload routes decode what they get (not "not served")."""
    d = tmp_path_factory.mktemp("fuzz-models")
    models = ["--pctr", frappe_deepfm.path, "--asr", _asr_run(d), "--vision", _vision_run(d)]
    s = serve([*models, "--max-instances", "50", "--max-body-bytes", "200000"], tmp_path_factory)
    # the upload routes are live: a real WAV / image is answered 200
    wav, img = _wav(d / "ok.wav").read_bytes(), (d / "imgs" / "cat" / "0.jpg").read_bytes()
    assert s.client.post("/v1/asr/transcribe", files={"file": ("a.wav", wav)}).status_code == 200
    assert s.client.post("/v1/vision/classify", files={"file": ("a.jpg", img)}).status_code == 200
    yield s
    s.stop()


@pytest.fixture(scope="module")
def spec(server):
    return server.client.get("/openapi.json").json()


def check(r: httpx.Response) -> None:
    """The service's contract for any request: no 5xx; a 4xx names the problem in JSON."""
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        body = r.json()
        assert isinstance(body.get("error"), str) and body["error"], body


# ------------------------------------------------------------------------------------ hand-written
def test_hand_written_malformed_requests(server):
    line = strip_label(head_lines(FRAPPE, 1)[0], "libfm")
    c = server.client
    J = {"content-type": "application/json"}
    cases = [
        # (method, path, kwargs, expected status)
        ("post", "/v1/pctr/predict", {"content": b"", "headers": J}, 422),
        ("post", "/v1/pctr/predict", {"content": b"{not json", "headers": J}, 422),
        ("post", "/v1/pctr/predict", {"content": b"\xff\xfe\x00", "headers": J}, 400),
        ("post", "/v1/pctr/predict", {"content": b"[" * 100_000, "headers": J}, 400),
        ("post", "/v1/pctr/predict", {"json": []}, 422),
        ("post", "/v1/pctr/predict", {"json": {}}, 422),
        ("post", "/v1/pctr/predict", {"json": {"instances": []}}, 422),
        ("post", "/v1/pctr/predict", {"json": {"instances": "1:1"}}, 422),
        ("post", "/v1/pctr/predict", {"json": {"instances": [1, 2]}}, 422),
        ("post", "/v1/pctr/predict", {"json": {"instances": [None]}}, 422),
        ("post", "/v1/pctr/predict", {"json": {"instances": [[line]]}}, 422),
        ("post", "/v1/pctr/predict", {"json": {"instances": [line], "extra": 1}}, 422),
        ("post", "/v1/pctr/predict", {"json": {"instances": [line] * 51}}, 422),  # too many instances
        ("post", "/v1/pctr/predict", {"json": {"instances": ["1:1 " * 60_000]}}, 413),  # body too large
        (
            "post",
            "/v1/pctr/predict",
            {"json": {"instances": ["\x00", "1:1e999", "-3:1", "99999999999999999999:1"]}},
            422,
        ),
        ("post", "/v1/pctr/predict", {"json": {"instances": [{"features": [[1e308, 1]]}]}}, 422),
        ("post", "/v1/pctr/predict", {"json": {"instances": [{"features": [["x", []]]}]}}, 422),
        (
            "post",
            "/v1/pctr/predict",
            {"content": json.dumps({"instances": [line]}), "headers": {"content-type": "text/plain"}},
            415,
        ),
        ("get", "/v1/pctr/predict", {}, 405),
        ("get", "/nope", {}, 404),
        ("post", "/v1/admin/reload", {"json": {"app": "nope"}}, 404),
        ("post", "/v1/admin/reload", {"json": {"app": "pctr", "run_dir": "/nonexistent"}}, 403),
        ("post", "/v1/admin/reload", {"json": {"run_dir": "/tmp"}}, 422),  # which of the 3 apps?
        ("post", "/v1/admin/reload", {"json": {"bogus": 1}}, 422),
        ("post", "/v1/admin/reload", {"content": b"x" * 100_000, "headers": J}, 413),
        ("post", "/v1/asr/transcribe", {"content": b"not multipart"}, 422),
        (
            "post",
            "/v1/vision/classify",
            {"files": {"file": ("x.png", b"\x89PNG\r\n\x1a\n" + b"0" * 10)}},
            422,  # served: a truncated PNG is refused by the decoder
        ),
    ]
    for method, path, kw, want in cases:
        try:
            r = getattr(c, method)(path, **kw)
        except httpx.RemoteProtocolError:  # a body we refused is not read; the server closed the connection
            pytest.fail(f"{method} {path}: connection dropped instead of an answer")
        check(r)
        assert r.status_code == want, (method, path, str(kw)[:100], r.status_code, r.text[:300])
    # A malformed Content-Length (httpx will not send one): refused by the HTTP layer with a 400.
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(10)
        s.sendall(
            b"POST /v1/pctr/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: abc\r\n\r\n{}"
        )
        assert s.recv(4096).startswith(b"HTTP/1.1 400 ")
    # A client that promises a body and disconnects must not hurt the server.
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(
            b"POST /v1/pctr/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"instances": ['
        )
    # Still serving, the valid instance still answered correctly.
    r = server.predict([line])
    assert r.status_code == 200 and server.alive()


# ---------------------------------------------------------------------------------- property-based
def _resolve(spec: dict, schema: dict) -> dict:
    while "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        schema = spec["components"]["schemas"][name]
    return schema


def from_schema(spec: dict, schema: dict) -> st.SearchStrategy:
    """A hypothesis strategy for the JSON values valid under an OpenAPI 3.1 (JSON Schema) ``schema``."""
    schema = _resolve(spec, schema)
    if "anyOf" in schema:
        return st.one_of([from_schema(spec, s) for s in schema["anyOf"]])
    t = schema.get("type")
    if t == "string":
        return st.text(max_size=60) | st.sampled_from(["1:1", "451:1 4149:1", "a:b", "\t" * 38, ""])
    if t == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if t == "number":
        return st.floats(allow_nan=False)
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    if t == "array":
        items = from_schema(spec, schema.get("items", {}))
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 8), 8))
    if t == "object":
        props = {k: from_schema(spec, v) for k, v in schema.get("properties", {}).items()}
        required = set(schema.get("required", ()))
        extra = schema.get("additionalProperties", True)
        if not props:
            vals = ANY_JSON if extra in (True, {}) else from_schema(spec, extra)
            return st.dictionaries(
                st.text(max_size=8) | st.sampled_from(["features", "I1", "C1"]), vals, max_size=4
            )
        return st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
    return ANY_JSON


def _body_schema(spec: dict, path: str) -> dict:
    content = spec["paths"][path]["post"]["requestBody"]["content"]
    return content["application/json"]["schema"]


def mutate(value) -> st.SearchStrategy:
    """Schema-valid bodies, and malformed variants of them: a key dropped, a value's type changed, junk
    added, the whole body replaced by arbitrary JSON."""
    strategies = [st.just(value), ANY_JSON]
    if isinstance(value, dict) and value:
        keys = sorted(value)
        strategies.append(st.sampled_from(keys).map(lambda k: {x: y for x, y in value.items() if x != k}))
        strategies.append(st.tuples(st.sampled_from(keys), ANY_JSON).map(lambda kv: {**value, kv[0]: kv[1]}))
        strategies.append(st.tuples(st.text(max_size=8), ANY_JSON).map(lambda kv: {**value, kv[0]: kv[1]}))
    return st.one_of(strategies)


@pytest.mark.parametrize("path", ["/v1/pctr/predict", "/v1/admin/reload"])
def test_property_based_requests_from_openapi_schema(path, server, spec):
    body = from_schema(spec, _body_schema(spec, path)).flatmap(mutate)

    @settings(
        max_examples=120 if path == "/v1/pctr/predict" else 40,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=body)
    def prop(body):
        # json.dumps, not httpx's json=: NaN/Infinity literals (not strict JSON) are sent too.
        data = json.dumps(body).encode()
        check(server.client.post(path, content=data, headers={"content-type": "application/json"}))

    prop()
    assert server.alive()


def test_property_based_uploads(server):
    """Multipart uploads of arbitrary bytes (under both upload routes' field name and wrong ones)."""

    @settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(
        data=st.binary(max_size=300),
        field=st.sampled_from(["file", "upload"]),
        path=st.sampled_from(["/v1/asr/transcribe", "/v1/vision/classify"]),
    )
    def prop(data, field, path):
        r = server.client.post(path, files={field: ("f", data)})
        check(r)
        assert "not served" not in r.text and "--asr" not in r.text and "--vision" not in r.text, r.text

    prop()
    assert server.alive()
