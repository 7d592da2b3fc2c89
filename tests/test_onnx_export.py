"""``mariana export RUN --format onnx`` and ``mariana serve --runtime onnxruntime`` (issue 44.3), on real runs:
the session's pCTR runs (`trained_runs`: a Frappe DeepFM with dropout, a Frappe FM, a Criteo DCN with dense
features) and a tiny vision and ASR run trained here the way `test_app_registry` trains them.

Each export passes ``onnx.checker`` and records itself in ``model.onnx.json``; ONNX Runtime then answers real
held-out inputs (Frappe's and Criteo's last lines, CIFAR test-dev JPEGs, the held-out speaker's WAVs) as torch
does, through the app's own inference object (parsing, features and decoding stay in torch): probabilities
within atol 1e-5, the same top classes, the same transcripts. A served ``--runtime onnxruntime`` answers as
the torch runtime; a model.onnx exported from other weights, or none, is refused in one line."""

from __future__ import annotations

import bisect
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from fastapi.testclient import TestClient
from helpers import DATA
from mariana.apps.asr.features import load_audio
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.registry import get_app
from mariana.serving.app import ServeConfig, create_app
from mariana.serving.onnx_runtime import load as load_onnx
from trained_runs import CRITEO, FRAPPE, cli_in_process, fresh_copy, run_ok, train

TEST_DEV = DATA / "cifar10" / "test-dev.tar"
FSDD = DATA / "fsdd" / "recordings"
ATOL = 1e-5


def _export(run: Path) -> dict:
    """``mariana export RUN --format onnx`` in this process; checks its files and returns model.onnx.json."""
    stdout, _ = run_ok(["export", run, "--format", "onnx"])
    assert stdout.splitlines()[-1].startswith(f"wrote {run / 'model.onnx'} "), stdout
    onnx.checker.check_model(onnx.load(run / "model.onnx"), full_check=True)
    info = json.loads((run / "model.onnx.json").read_text())
    version = json.loads((run / "model.json").read_text())["version"]
    assert info["source_version"] == version and info["opset"] == 18 and info["check"]["max_abs_diff"] <= ATOL
    return info


@pytest.fixture(scope="module")
def vision_run(tmp_path_factory) -> Path:
    argv = ["vision", "train", "--data", DATA / "cifar10" / "train.tar", "--preset", "debug", "--limit", "64"]
    return train(
        [*argv, "--max-steps", "3", "--no-progress"], tmp_path_factory.mktemp("onnx") / "vision"
    ).path


@pytest.fixture(scope="module")
def asr_run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("onnx-asr")
    (d / "fsdd").mkdir()
    for spk in ("george", "lucas", "jackson"):
        for name in (f"{digit}_{spk}_{take}.wav" for digit in range(10) for take in range(2)):
            (d / "fsdd" / name).symlink_to(FSDD / name)
    prep = ["asr", "prepare", "--data", d / "fsdd", "--test-speakers", "jackson", "--utterances", "16"]
    train([*prep, "--max-digits", "2"], d / "asr-data")
    argv = [
        "asr",
        "train",
        "--data",
        d / "asr-data",
        "--preset",
        "debug",
        "--max-steps",
        "3",
        "--no-progress",
    ]
    return train(argv, d / "run").path


def _held_out_lines(path: Path, n: int = 200) -> list[str]:
    """The file's last ``n`` records without their label (the test split's end: never trained on)."""
    lines = path.read_text().splitlines()[-n:]
    return [line.split("\t", 1)[1] if "\t" in line else line.split(None, 1)[1] for line in lines]


@pytest.mark.parametrize("name", ["frappe_deepfm", "frappe_fm", "criteo_dcn"])
def test_pctr_onnxruntime_equals_torch(name, request, tmp_path):
    run = fresh_copy(request.getfixturevalue(name), tmp_path / "run")
    info = _export(run)
    assert info["app"] == "pctr" and list(info["inputs"]) == ["ids", "vals", "dense"]
    assert info["inputs"]["ids"][0] == "batch" and info["output"] == "probs"
    lines = _held_out_lines(CRITEO if name == "criteo_dcn" else FRAPPE)
    torch_probs, errors = get_app("pctr").load(str(run)).predict_lines(lines)
    ort_probs, ort_errors = load_onnx(get_app("pctr"), str(run)).predict_lines(lines)
    assert errors == ort_errors and len(torch_probs) == len(lines)
    np.testing.assert_allclose(np.array(ort_probs, float), np.array(torch_probs, float), atol=ATOL, rtol=0)


def test_pctr_ids_as_documented(frappe_deepfm, tmp_path):
    """apps/pctr/README.md's ONNX section, followed by a client with no mariana code: a libFM id goes to the
    field whose range (``schema.field_starts``) holds it, row ``f * R + 1 + id % (R - 1)``; model.onnx fed so
    answers what the torch predictor does."""
    run = fresh_copy(frappe_deepfm, tmp_path / "run")
    _export(run)
    schema = json.loads((run / "model.json").read_text())["schema"]
    R, starts = schema["rows_per_field"], schema["field_starts"]
    lines = _held_out_lines(FRAPPE, 100)
    pairs = [
        sorted((int(i), float(v)) for i, v in (tok.split(":") for tok in line.split())) for line in lines
    ]
    field = lambda i: bisect.bisect_right(starts, i) - 1  # noqa: E731
    assert all([field(i) for i, _ in p] == list(range(schema["num_fields"])) for p in pairs)
    ids = np.array([[f * R + 1 + i % (R - 1) for f, (i, _) in enumerate(p)] for p in pairs], np.int64)
    vals = np.array([[v for _, v in p] for p in pairs], np.float32)
    session = onnxruntime.InferenceSession(str(run / "model.onnx"), providers=["CPUExecutionProvider"])
    probs = session.run(None, {"ids": ids, "vals": vals, "dense": np.zeros((len(lines), 0), np.float32)})[0]
    want, _ = get_app("pctr").load(str(run)).predict_lines(lines)
    np.testing.assert_allclose(probs, want, atol=ATOL, rtol=0)


def _jpegs(n: int = 8) -> list[bytes]:
    with tarfile.open(TEST_DEV) as t:
        files = [m for m in t if m.isfile() and m.name.lower().endswith((".jpg", ".jpeg"))][:n]
        return [t.extractfile(m).read() for m in files]


def test_vision_onnxruntime_equals_torch(vision_run, tmp_path):
    run = fresh_copy(vision_run, tmp_path / "run")
    info = _export(run)
    assert info["inputs"]["images"] == ["batch", 3, 32, 32] and info["output"] == "logits"
    clf, ort_clf = get_app("vision").load(str(run)), load_onnx(get_app("vision"), str(run))
    for data in _jpegs():
        for tta in ("none", "crops"):  # batches of 1 and 6 views through the dynamic batch axis
            want, got = clf.classify_bytes(data, 10, tta), ort_clf.classify_bytes(data, 10, tta)
            assert [c for c, _ in got] == [c for c, _ in want]
            np.testing.assert_allclose([p for _, p in got], [p for _, p in want], atol=ATOL, rtol=0)


def _test_wavs(run: Path) -> list[Path]:
    scp = run.parent / "asr-data" / "test" / "wav.scp"
    return [Path(line.split()[1]) for line in scp.read_text().splitlines()]


def test_asr_onnxruntime_equals_torch(asr_run, tmp_path):
    run = fresh_copy(asr_run, tmp_path / "run")
    shutil.copytree(asr_run.parent / "asr-data", tmp_path / "asr-data", symlinks=True)
    info = _export(run)
    assert info["inputs"]["feats"][:2] == ["batch", "frames"] and info["output"] == "log_probs"
    tr, ort_tr = get_app("asr").load(str(run)), load_onnx(get_app("asr"), str(run))
    for wav in _test_wavs(run):  # the held-out speaker: features of every length through the frames axis
        x = tr.features(load_audio(str(wav), tr.settings)).unsqueeze(0)
        with torch.no_grad():
            np.testing.assert_allclose(ort_tr.model(x).numpy(), tr.model(x).numpy(), atol=ATOL, rtol=1e-5)
        assert ort_tr.transcribe_file(wav) == tr.transcribe_file(wav)


def test_serve_onnxruntime_answers_as_torch(frappe_deepfm, vision_run, asr_run, tmp_path):
    """The same requests to a torch server and an onnxruntime server of the same runs: equal answers, the
    same model versions."""
    runs = {
        "pctr": fresh_copy(frappe_deepfm, tmp_path / "pctr"),
        "vision": fresh_copy(vision_run, tmp_path / "vision"),
    }
    runs["asr"] = fresh_copy(asr_run, tmp_path / "asr")
    shutil.copytree(asr_run.parent / "asr-data", tmp_path / "asr-data", symlinks=True)
    for run in runs.values():
        _export(run)
    lines, jpeg, wav = _held_out_lines(FRAPPE, 50), _jpegs(1)[0], _test_wavs(runs["asr"])[0].read_bytes()
    answers = []
    for runtime in ("torch", "onnxruntime"):
        cfg = ServeConfig(models={a: str(r) for a, r in runs.items()}, threads=1, runtime=runtime)
        with TestClient(create_app(cfg)) as c:
            health = c.get("/healthz").json()["models"]
            pctr = c.post("/v1/pctr/predict", json={"instances": lines}).json()
            vision = c.post("/v1/vision/classify", files={"file": ("a.jpg", jpeg, "image/jpeg")}).json()
            asr = c.post("/v1/asr/transcribe", files={"file": ("a.wav", wav, "audio/wav")}).json()
        answers.append(({a: m["version"] for a, m in health.items()}, pctr, vision, asr))
    (v_t, p_t, c_t, a_t), (v_o, p_o, c_o, a_o) = answers
    (runs["vision"] / "model.onnx").unlink()  # the onnxruntime server really loads model.onnx
    with pytest.raises(MarianaError, match=r"--vision .*: no model.onnx"):
        create_app(ServeConfig(models={"vision": str(runs["vision"])}, threads=1, runtime="onnxruntime"))
    assert v_t == v_o and p_t["model_version"] == p_o["model_version"]
    np.testing.assert_allclose(p_o["probabilities"], p_t["probabilities"], atol=ATOL, rtol=0)
    assert [x["label"] for x in c_o["labels"]] == [x["label"] for x in c_t["labels"]], (c_t, c_o)
    want = [x["probability"] for x in c_t["labels"]]
    np.testing.assert_allclose([x["probability"] for x in c_o["labels"]], want, atol=ATOL, rtol=0)
    assert a_o["transcript"] == a_t["transcript"] and a_o["model_version"] == a_t["model_version"]


def test_stale_or_missing_onnx_model_is_refused(frappe_deepfm, frappe_fm, tmp_path):
    run = fresh_copy(frappe_deepfm, tmp_path / "run")
    with pytest.raises(MarianaError, match=r"no model.onnx \(run `mariana export .* --format onnx` first\)"):
        load_onnx(get_app("pctr"), str(run))
    _export(run)
    for name in ("model.safetensors", "model.json"):  # the run's model replaced by other weights
        shutil.copy(frappe_fm.path / name, run / name)
    with pytest.raises(
        MarianaError, match=r"was exported from model version \w+, the run's model is \w+: export"
    ):
        load_onnx(get_app("pctr"), str(run))
    rc, _, err = cli_in_process(["serve", "--pctr", run, "--runtime", "onnxruntime", "--port", "0"])
    assert rc == 2 and err.strip().splitlines()[-1].startswith(f"mariana: error: --pctr {run}: "), err
    rc, _, err = cli_in_process(["export", tmp_path, "--format", "onnx"])
    assert rc == 2 and "no exported model" in err, err
