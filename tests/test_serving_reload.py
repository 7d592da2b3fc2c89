"""Hot reload of a served model (`POST /v1/admin/reload` and `--watch`): the switch is atomic (every answer
comes entirely from the version it names), no request of a steady stream fails while models are swapped,
and a model that fails to load is refused while the old one keeps serving."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
from mariana.apps.pctr.models.predict import load_predictor
from test_serving_helpers import FRAPPE, head_lines, serve, strip_label


@pytest.fixture(scope="module")
def runs(frappe_deepfm, frappe_fm):
    """Two shared runs of the same data (read only here: a test that edits one copies it first)."""
    return frappe_deepfm.path, frappe_fm.path


def _expected(run, lines) -> tuple[str, list[float]]:
    pred = load_predictor(run)
    probs, errors = pred.predict_lines(lines)
    assert not errors
    return pred.version, probs


def _corrupt_copy(src, dst):
    shutil.copytree(src, dst)
    data = (dst / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated: must be refused
    return dst


def test_reload_during_steady_stream(runs, tmp_path, tmp_path_factory):
    a, b = runs
    lines = [strip_label(ln, "libfm") for ln in head_lines(FRAPPE, 8)]
    expected = dict([_expected(a, lines), _expected(b, lines)])
    assert len(expected) == 2, "the two runs must have different versions"
    bad = _corrupt_copy(a, tmp_path / "bad")
    (tmp_path / "token").write_text("reload-secret\n")
    root = tmp_path_factory.getbasetemp()  # a, b and bad live under it; the Frappe folder does not
    srv = serve(["--pctr", a, "--reload-root", root, "--token-file", tmp_path / "token"], tmp_path_factory)
    # admin requests need the token; a run dir outside --reload-root (symlinks resolved) is refused unread
    assert srv.client.post("/v1/admin/reload", json={}).status_code == 401
    assert (
        srv.client.post("/v1/admin/reload", json={}, headers={"Authorization": "Bearer no"}).status_code
        == 401
    )
    srv.client.headers["Authorization"] = "Bearer reload-secret"
    (tmp_path / "escape").symlink_to(FRAPPE.parent)
    for outside in (FRAPPE.parent, tmp_path / "escape"):
        r = srv.client.post("/v1/admin/reload", json={"app": "pctr", "run_dir": str(outside)})
        assert r.status_code == 403 and "outside the reload roots" in r.json()["error"], r.text
    assert srv.client.get("/healthz").status_code == 200  # loopback reads and predictions need no token
    results, stop = [], threading.Event()

    def client(k: int):
        import httpx

        with httpx.Client(base_url=srv.url, timeout=30) as c:
            i = 0
            while not stop.is_set():
                n = 1 + (i + k) % len(lines)  # single-instance and small batch requests
                try:
                    r = c.post("/v1/pctr/predict", json={"instances": lines[:n]})
                    results.append((n, r.status_code, r.json()))
                except Exception as e:  # noqa: BLE001  -- a dropped connection is a failure too
                    results.append((n, type(e).__name__, None))
                i += 1
                time.sleep(0.002)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    try:
        for t in threads:
            t.start()
        outcomes = []
        for i in range(6):
            time.sleep(0.25)
            target = bad if i == 3 else (b if i % 2 == 0 else a)
            r = srv.client.post("/v1/admin/reload", json={"app": "pctr", "run_dir": str(target)})
            outcomes.append(r.status_code)
            if target is bad:
                assert r.status_code == 422 and "refused" in r.json()["error"], r.text
                assert srv.client.get("/healthz").json()["models"]["pctr"]["run_dir"] == str(b)
        # Reload of the current run dir (no run_dir): same files, same version.
        assert srv.client.post("/v1/admin/reload", json={}).status_code == 200
        time.sleep(0.25)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        metrics = srv.client.get("/metrics").text
        srv.stop()
    assert outcomes == [200, 200, 200, 422, 200, 200]
    assert len(results) > 50, len(results)
    failed = [(n, s) for n, s, _ in results if s != 200]
    assert not failed, failed[:10]
    seen = set()
    for n, _, body in results:
        v = body["model_version"]
        seen.add(v)
        # Atomic: the answer is exactly the one of the version it names (never a mix of two models).
        assert body["probabilities"] == pytest.approx(expected[v][:n], abs=1e-6), v
    assert seen == set(expected)
    assert 'mariana_model_reloads_total{app="pctr",result="failed"} 1' in metrics


def test_watch_reloads_new_exports_and_refuses_bad_ones(runs, tmp_path, tmp_path_factory):
    a, b = runs
    live = tmp_path / "live"
    shutil.copytree(a, live)
    lines = [strip_label(ln, "libfm") for ln in head_lines(FRAPPE, 3)]
    va, pa = _expected(a, lines)
    vb, pb = _expected(b, lines)
    srv = serve(["--pctr", live, "--watch", "--watch-interval", "0.2"], tmp_path_factory)

    def wait_version(v, timeout=20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            body = srv.predict(lines).json()
            if body["model_version"] == v:
                return body
            time.sleep(0.1)
        raise AssertionError(f"server still serves {body['model_version']}, expected {v}\n{srv.output()}")

    try:
        assert srv.predict(lines).json()["model_version"] == va
        # A new export lands (atomically per file, as export_model writes it).
        for name in ("model.safetensors", "model.json"):
            shutil.copy(b / name, live / (name + ".tmp"))
            os.replace(live / (name + ".tmp"), live / name)
        assert wait_version(vb)["probabilities"] == pytest.approx(pb, abs=1e-6)
        # A broken export: refused, the previous version keeps answering.
        (live / "model.safetensors").write_bytes(b"\x00" * 64)
        time.sleep(1.5)
        body = srv.predict(lines).json()
        assert body["model_version"] == vb and body["probabilities"] == pytest.approx(pb, abs=1e-6)
        assert "refused" in srv.output()
        # Fixed again: picked up.
        for name in ("model.safetensors", "model.json"):
            shutil.copy(a / name, live / (name + ".tmp"))
            os.replace(live / (name + ".tmp"), live / name)
        assert wait_version(va)["probabilities"] == pytest.approx(pa, abs=1e-6)
        assert srv.alive()
    finally:
        srv.stop()
