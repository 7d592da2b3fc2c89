"""Every registered app (`mariana.platform.core.registry.all_apps`) end to end: a few training steps of its
``debug`` preset on tiny real data through the real CLI, the one export format (``model.json``: app, arch,
config, created, metrics, version = the weights' digest), its serving loader from the registry answering one
real input, and ``mariana serve``'s app built from the registry with one router per app."""

from __future__ import annotations

import datetime
import json
import tarfile
from pathlib import Path

import pytest
from helpers import DATA
from mariana.platform.core.export import REQUIRED_KEYS, load_exported, weights_digest
from mariana.platform.core.registry import all_apps, get_app, serving_apps
from trained_runs import cli_here

FRAPPE = DATA / "frappe" / "frappe.validation.libfm"
CIFAR = DATA / "cifar10" / "train.tar"
FSDD = DATA / "fsdd" / "recordings"
STEPS = ["--max-steps", "3", "--no-progress"]


def _asr_data(d: Path) -> Path:
    """A prepared ASR data dir: 2 takes of every digit by 2 training speakers, jackson held out."""
    fsdd = d / "fsdd"
    fsdd.mkdir()
    for spk in ("george", "lucas", "jackson"):
        for digit in range(10):
            for take in range(2):
                name = f"{digit}_{spk}_{take}.wav"
                (fsdd / name).symlink_to(FSDD / name)
    data = d / "asr-data"
    cli_here(
        ["asr", "prepare", "--data", fsdd, "--out", data, "--test-speakers", "jackson"]
        + ["--utterances", "16", "--max-digits", "2"],
        check=True,
    )
    return data


def _train_args(app: str, d: Path) -> list:
    """``mariana APP train`` on tiny data with the app's ``debug`` preset (no --out)."""
    if app in ("mlp", "pctr"):
        extra = ["--format", "libfm"] if app == "pctr" else []
        return [app, "train", "--data", FRAPPE, *extra, "--preset", "debug", *STEPS]
    if app == "vision":
        return ["vision", "train", "--data", CIFAR, "--preset", "debug", "--limit", "64", *STEPS]
    if app == "asr":
        return ["asr", "train", "--data", _asr_data(d), "--preset", "debug", *STEPS]
    raise AssertionError(f"no tiny-data recipe for app {app!r}: add one to this test")


def _first_jpeg() -> bytes:
    with tarfile.open(CIFAR) as t:
        for m in t:
            if m.isfile() and m.name.lower().endswith((".jpg", ".jpeg", ".png")):
                return t.extractfile(m).read()
    raise AssertionError(f"no image in {CIFAR}")


def _predict_one(app: str, obj, run: Path):
    """One real input through the app's inference object (the inputs the serving tests use)."""
    if app == "pctr":
        line = FRAPPE.read_text().splitlines()[0].split(None, 1)[1]  # a record without its label
        probs, errors = obj.predict_lines([line])
        assert not errors and 0.0 < probs[0] < 1.0, (probs, errors)
        return probs[0]
    if app == "asr":
        wav = (run.parent / "asr-data" / "test" / "wav.scp").read_text().split()[1]
        text = obj.transcribe_wav_bytes(Path(wav).read_bytes())
        assert isinstance(text, str)
        return text
    if app == "vision":
        top = obj.classify_bytes(_first_jpeg(), k=3)
        assert len(top) == 3 and all(0.0 <= p <= 1.0 for _, p in top)
        return top
    raise AssertionError(f"no input for app {app!r}: add one to this test")


_RUNS: dict[str, Path] = {}


def _trained(app: str, tmp_path_factory) -> Path:
    """The run directory of a tiny training of ``app`` (trained once per session)."""
    if app not in _RUNS:
        d = tmp_path_factory.mktemp(f"registry-{app}")
        run = d / "run"
        cli_here([*_train_args(app, d), "--out", run], check=True)
        _RUNS[app] = run
    return _RUNS[app]


def test_registry_lists_the_apps_and_rejects_unknown_ones():
    names = [s.name for s in all_apps()]
    assert set(names) >= {"mlp", "asr", "vision", "pctr"} and len(names) == len(set(names))
    assert all(get_app(n).name == n for n in names)
    from mariana.platform.core.errors import MarianaError

    with pytest.raises(MarianaError, match=r"unknown app 'nope': expected one of .*pctr"):
        get_app("nope")
    # Every app's CLI group is registered; `serve` has one --APP flag per servable app.
    from mariana.platform.cli.main import build_parser

    parser = build_parser()
    groups = next(a for a in parser._actions if a.dest == "command").choices
    assert set(names) <= set(groups)
    serve_flags = {o for a in groups["serve"]._actions for o in a.option_strings}
    assert {f"--{s.name}" for s in serving_apps()} <= serve_flags


@pytest.mark.slow
@pytest.mark.parametrize("app", [s.name for s in all_apps()])
def test_app_trains_exports_and_serves(app, tmp_path_factory):
    spec = get_app(app)
    run = _trained(app, tmp_path_factory)
    meta = json.loads((run / "model.json").read_text())
    assert set(REQUIRED_KEYS) <= set(meta), sorted(meta)
    assert meta["app"] == app and "job" not in meta
    assert isinstance(meta["arch"], str) and meta["arch"]
    assert isinstance(meta["config"], dict) and meta["config"]["max_steps"] == 3
    assert isinstance(meta["metrics"], dict)
    created = datetime.datetime.fromisoformat(meta["created"])
    assert created.utcoffset() == datetime.timedelta(0)
    state, embedded = load_exported(run)
    assert meta["version"] == weights_digest(state) == embedded["version"]  # content digest, recomputed
    assert len(meta["version"]) == 16
    if not spec.servable:  # not served (the smoke-test job): its eval command scores the model
        assert spec.loader is None and spec.routes is None
        return
    obj = spec.load(str(run))
    assert obj.version == meta["version"]
    for method in spec.requires:
        assert callable(getattr(obj, method))
    _predict_one(app, obj, run)


@pytest.mark.slow
def test_serve_mounts_one_router_per_app_from_the_registry(tmp_path_factory):
    """`create_app` with every servable app's model: each app's routes come from its spec, the versions
    the server reports are the exported digests."""
    from fastapi.testclient import TestClient
    from mariana.serving.app import ServeConfig, create_app

    apps = serving_apps()
    runs = {s.name: _trained(s.name, tmp_path_factory) for s in apps}
    client_app = create_app(ServeConfig(models={a: str(r) for a, r in runs.items()}, threads=1))
    with TestClient(client_app) as c:
        health = c.get("/healthz").json()
        for a, r in runs.items():
            version = json.loads((r / "model.json").read_text())["version"]
            assert health["models"][a]["version"] == version
        paths = set(c.get("/openapi.json").json()["paths"])
        assert {"/healthz", "/metrics", "/v1/admin/reload"} <= paths
        for a in runs:
            assert any(p.startswith(f"/v1/{a}/") for p in paths), (a, paths)
        if "pctr" in runs:
            line = FRAPPE.read_text().splitlines()[0].split(None, 1)[1]
            body = c.post("/v1/pctr/predict", json={"instances": [line]}).json()
            assert body["model_version"] == health["models"]["pctr"]["version"]
            offline = _predict_one("pctr", get_app("pctr").load(str(runs["pctr"])), runs["pctr"])
            assert body["probabilities"][0] == pytest.approx(offline, abs=1e-6)
