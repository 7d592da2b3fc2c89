"""`asr eval --tempo` and the one-file paths (`asr transcribe`, the Python API, `mariana serve --asr`) on one
trained run: the checks `tests/test_asr_accuracy.py` once made on its minutes-long `small` run, which need
no accurate model, on a tiny one trained once here in seconds (debug preset; george, lucas, nicolas and
yweweler train, jackson held out, 20 utterances of up to 5 digits each). Every command goes through the
CLI's entry point in this process (`run_main`)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from cliwalk import run_main
from helpers import last_line
from mariana.apps.asr.evaluate import TEMPO_GRID
from mariana.apps.asr.predict import load_transcriber
from mariana.platform.cli.main import main
from mariana.platform.core.rundir import eval_result_path
from test_serving_helpers import Server

HELD_OUT = "jackson"
DIGITS = {"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"}


@pytest.fixture(scope="module")
def tiny(data_dir, tmp_path_factory):
    """(run dir, test data dir) of a tiny model trained through the CLI, jackson held out. (A module
    fixture has no capsys: the two commands' output goes to the first test's setup log.)"""
    d = tmp_path_factory.mktemp("asr-tempo")
    data, run = d / "data", d / "run"
    prepare = ["asr", "prepare", "--data", data_dir / "fsdd/recordings", "--out", data, "--test-speakers",
               HELD_OUT, "--utterances", "20", "--max-digits", "5", "--seed", "0"]  # fmt: skip
    assert main([str(a) for a in prepare]) == 0
    train = ["asr", "train", "--data", data, "--out", run, "--preset", "debug", "--epochs", "20",
             "--lr", "3e-3", "--hidden", "128", "--context", "10", "--no-progress"]  # fmt: skip
    assert main([str(a) for a in train]) == 0
    torch.set_flush_denormal(False)  # `asr train` flushes denormals for its process: not for the evals here
    return run, data / "test"


def test_tempo_fixed_auto_and_refused(tiny, capsys):
    """--tempo 1.15 (speaking-rate normalisation) takes frames every 11.5 ms: 1/1.15 of the frames, cached
    separately from the 10 ms features; --tempo auto picks the factor the model is most confident at (no
    transcripts) and then scores exactly what a fixed --tempo of that factor scores; out-of-range factors
    are refused."""
    run, test = tiny
    result_path = eval_result_path(run, test)
    rc, out, err = run_main(["asr", "eval", "--model", run, "--data", test], capsys)  # the 10 ms features
    assert rc == 0 and re.fullmatch(r"WER \d+\.\d\d% SER \d+\.\d\d%", last_line(out)), err
    before = {p.parent for p in (run / "feats").glob("*/index.json")}
    (plain,) = before
    rc, out, err = run_main(["asr", "eval", "--model", run, "--data", test, "--tempo", "1.15"], capsys)
    assert rc == 0 and re.fullmatch(r"WER \d+\.\d\d% SER \d+\.\d\d%", last_line(out)), err
    assert json.loads(result_path.read_text())["tempo"] == 1.15
    (new,) = {p.parent for p in (run / "feats").glob("*/index.json")} - before
    frames = [
        sum(u["frames"] for u in json.loads((f / "index.json").read_text())["utts"]) for f in (plain, new)
    ]
    assert abs(frames[1] / frames[0] - 1 / 1.15) < 0.01, frames

    rc, out, err = run_main(["asr", "eval", "--model", run, "--data", test, "--tempo", "auto"], capsys)
    assert rc == 0, err
    auto = json.loads(result_path.read_text())
    assert auto["tempo"] == "auto" and set(auto["speaker_tempo"]) == {HELD_OUT}
    chosen = auto["speaker_tempo"][HELD_OUT]
    assert chosen in TEMPO_GRID and f"({HELD_OUT}={chosen:g})" in out
    rc, out, err = run_main(["asr", "eval", "--model", run, "--data", test, "--tempo", str(chosen)], capsys)
    assert rc == 0 and json.loads(result_path.read_text())["wer"] == auto["wer"]
    print(f"--tempo auto: {HELD_OUT} x{chosen}, WER {auto['wer']:.2f}%")
    rc, out, err = run_main(["asr", "eval", "--model", run, "--data", test, "--tempo", "5"], capsys)
    assert rc != 0 and "--tempo must be in [0.5, 2]" in err, err


def test_transcribe_the_api_and_the_server_say_what_eval_cmvn_file_says(tiny, tmp_path, capsys):
    """`eval --cmvn file` scores each file alone with the training speakers' prior: `transcribe` prints
    its words for each file, the Python API and `mariana serve --asr` give the same words for the same
    file, with the weights' digest as the model version; bad uploads get a 4xx with a clear error."""
    run, test = tiny
    rc, out, err = run_main(["asr", "eval", "--model", run, "--data", test, "--cmvn", "file"], capsys)
    assert rc == 0, err
    per_file = json.loads(eval_result_path(run, test).read_text())
    assert per_file["cmvn"] == "file"
    wavs = dict(ln.split() for ln in (test / "wav.scp").read_text().splitlines()[:10])
    rc, out, err = run_main(["asr", "transcribe", "--model", run, *wavs.values()], capsys)
    assert rc == 0, err
    said = dict(ln.split("\t") for ln in out.splitlines()[:-1])
    assert {u: said[p] for u, p in wavs.items()} == {u: per_file["hypotheses"][u] for u in wavs}
    # a file the tiny model says something for (the small model of the accuracy gate says words for all)
    wav_path = next(p for p in wavs.values() if said[p])
    words = said[wav_path]
    assert words and all(w in DIGITS for w in words.split())

    tr = load_transcriber(run)
    assert tr.transcribe_wav_bytes(open(wav_path, "rb").read()) == words
    assert tr.version == json.loads((run / "model.json").read_text())["version"]  # the weights' digest

    # ... and over HTTP from a real `mariana serve --asr` (uvicorn on a free loopback port).
    srv = Server(["--asr", run, "--threads", "1"], tmp_path)
    try:
        wav = open(wav_path, "rb").read()
        resp = srv.client.post("/v1/asr/transcribe", files={"file": ("a.wav", wav, "audio/wav")})
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"transcript": words, "model_version": tr.version}
        for junk, status, text in [
            (b"not audio" * 50, 415, "not a WAV/FLAC/OGG file"),  # rejected on its header
            (b"RIFF\x24\x00\x00\x00WAVE" + b"junk" * 50, None, "uploaded audio"),  # fails in the decoder
        ]:
            bad = srv.client.post("/v1/asr/transcribe", files={"file": ("a.wav", junk, "audio/wav")})
            assert 400 <= bad.status_code < 500 and (status is None or bad.status_code == status), bad.text
            assert text in bad.json()["error"] and "BytesIO" not in bad.text, bad.text
    finally:
        srv.stop()
