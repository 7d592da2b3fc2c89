"""`mariana asr transcribe`, the REST endpoint and `asr eval --cmvn file` give the same words for the same
file (issue 21): a tiny model trained through the CLI (2 speakers, the third held out), then every
held-out file through each path. Also the per-file CMVN prior itself."""

from __future__ import annotations

import io
import json
import wave

import numpy as np
import pytest
from helpers import last_line
from mariana.apps.asr.cmvn import FilePrior, apply_cmvn, stats
from mariana.platform.core.rundir import eval_result_path
from trained_runs import cli_here, train


def test_file_prior_statistics_and_adaptation():
    rng = np.random.default_rng(0)
    a = rng.normal(1.0, 2.0, (400, 3)).astype(np.float32)  # speaker a: mean 1, std 2
    b = rng.normal(-3.0, 1.0, (100, 3)).astype(np.float32)  # speaker b: mean -3, std 1
    acc = {k: dict(zip(("sum", "sumsq", "frames"), stats(f))) for k, f in (("a", a), ("b", b))}
    p = FilePrior.from_speaker_stats(acc, frames=50.0)
    both = np.concatenate([a, b]).astype(np.float64)
    np.testing.assert_allclose(p.mean, both.mean(0), rtol=1e-6)  # frame-weighted mean of the means
    within = (400 * a.astype(np.float64).var(0) + 100 * b.astype(np.float64).var(0)) / 500
    np.testing.assert_allclose(p.var, within, rtol=1e-6)  # within-speaker, not the global variance
    assert np.all(np.asarray(p.var) < both.var(0))
    # The file's mean counts n frames against the prior's 50: a long file is centred on its own mean, a
    # short one leans on the prior; the variance is the prior's.
    f = rng.normal(5.0, 1.0, (950, 3)).astype(np.float32)
    mean = (50 * np.asarray(p.mean) + 950 * f.astype(np.float64).mean(0)) / 1000
    np.testing.assert_allclose(p.apply(f), (f - mean) / np.sqrt(p.var), rtol=1e-4, atol=1e-4)
    assert FilePrior.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    # frames=0 is per-utterance mean normalisation (with the prior's variance)
    p0 = FilePrior(p.mean, p.var, 0.0)
    np.testing.assert_allclose(p0.apply(f).mean(0), 0.0, atol=1e-4)
    np.testing.assert_allclose(apply_cmvn([f], ["u"])[0].std(0), 1.0, atol=1e-4)


def test_file_cmvn_features_use_the_training_speakers_prior(data_dir):
    """`extract` with cmvn "file": each utterance normalised alone with the prior of the set's own
    speakers (a training set) or with a given one (any other set), bit for bit as `FilePrior.apply`."""
    import dataclasses

    from mariana.apps.asr.data import Utterance
    from mariana.apps.asr.features import FeatureSettings, extract, perturbations

    rec = data_dir / "fsdd/recordings"
    utts = [
        Utterance(f"{s}-{d}", s, ["x"], str(rec / f"{d}_{s}_0.wav"))
        for s in ("george", "lucas")
        for d in (1, 2)
    ]
    raw_s = FeatureSettings(cmvn="none")
    _, raw, _, spk_stats = extract(utts, raw_s, jobs=1, copies=perturbations((1.0, 1.1)))
    assert set(spk_stats) == {"george", "lucas"}  # unperturbed audio only
    assert spk_stats["george"]["frames"] == sum(len(f) for f in raw[:2])
    prior = FilePrior.from_speaker_stats(spk_stats)
    _, own, _, _ = extract(utts, dataclasses.replace(raw_s, cmvn="file"), jobs=1)
    for a, f in zip(own, raw[:4]):
        np.testing.assert_array_equal(a, prior.apply(f))
    other = FilePrior(prior.mean, prior.var, 5.0)
    _, given, _, _ = extract(utts[:1], dataclasses.replace(raw_s, cmvn="file"), jobs=1, prior=other)
    np.testing.assert_array_equal(given[0], other.apply(raw[0]))


@pytest.fixture(scope="module")
def tiny_run(data_dir, tmp_path_factory):
    """A tiny model trained through the CLI on george + lucas (8 takes of each digit), jackson held out:
    (run dir, prepared data dir)."""
    d = tmp_path_factory.mktemp("asr-agree")
    fsdd = d / "fsdd"
    fsdd.mkdir()
    for spk in ("george", "lucas", "jackson"):
        for digit in range(10):
            for take in range(8):
                name = f"{digit}_{spk}_{take}.wav"
                (fsdd / name).symlink_to(data_dir / "fsdd/recordings" / name)
    # made in this process (`trained_runs.train`: no interpreter start-up); the tests read them
    data = train(
        [
            "asr",
            "prepare",
            "--data",
            fsdd,
            "--test-speakers",
            "jackson",
            "--utterances",
            "60",
            "--max-digits",
            "3",
        ],
        d / "data",
    ).path
    run = train(
        ["asr", "train", "--data", data, "--preset", "debug", "--epochs", "10", "--lr", "3e-3"]
        + ["--hidden", "128", "--context", "10", "--no-progress"],
        d / "run",
    ).path
    return run, data


def test_transcribe_equals_eval_cmvn_file_and_the_server(tiny_run, tmp_path):
    run, data = tiny_run
    meta = json.loads((run / "model.json").read_text())
    assert len(meta["cmvn_prior"]["mean"]) == 40  # the training speakers' statistics travel with the model

    e = cli_here(["asr", "eval", "--model", run, "--data", data / "test", "--cmvn", "file"])
    assert e.returncode == 0, e.stderr
    result = json.loads(eval_result_path(run, data / "test").read_text())
    assert result["cmvn"] == "file" and result["utterances"] == 60
    hyps = result["hypotheses"]
    assert len(hyps) == 60 and sum(bool(h) for h in hyps.values()) >= 30, hyps  # the model says something
    assert result["wer"] < 90.0, last_line(e.stdout)

    wavs = dict(line.split() for line in (data / "test" / "wav.scp").read_text().splitlines())
    t = cli_here(["asr", "transcribe", "--model", run, *wavs.values()], check=True)
    assert last_line(t.stdout) == "transcribed 60 of 60 file(s)"
    said = dict(line.split("\t") for line in t.stdout.splitlines()[:-1])
    assert {u: said[p] for u, p in wavs.items()} == hyps  # every file: the same words

    # The per-speaker mode (as in training) scores the same files with more context; both are recorded.
    s = cli_here(["asr", "eval", "--model", run, "--data", data / "test"], check=True)
    spk = json.loads(eval_result_path(run, data / "test").read_text())
    assert spk["cmvn"] == "speaker" and spk["utterances"] == 60
    print(f"eval --cmvn file: WER {result['wer']:.2f}%; --cmvn speaker: {last_line(s.stdout)}")

    # ... and over HTTP from a real `mariana serve --asr` (uvicorn on a free loopback port).
    from test_serving_helpers import Server

    srv = Server(["--asr", run, "--threads", "1"], tmp_path)
    try:
        for utt, path in list(wavs.items())[:5]:
            with open(path, "rb") as f:
                r = srv.client.post("/v1/asr/transcribe", files={"file": ("a.wav", f.read(), "audio/wav")})
            assert r.status_code == 200 and r.json()["transcript"] == hyps[utt], r.text
        import soundfile as sf  # issue 30.13: FLAC (which `asr transcribe` reads) is accepted over REST too

        utt, path = next(iter(wavs.items()))
        flac = io.BytesIO()
        sf.write(flac, *sf.read(path, dtype="int16"), format="FLAC")
        r = srv.client.post("/v1/asr/transcribe", files={"file": ("a.flac", flac.getvalue(), "audio/flac")})
        assert r.status_code == 200 and r.json()["transcript"] == hyps[utt], r.text
        r = srv.client.post(
            "/v1/asr/transcribe", files={"file": ("a.txt", b"hello, not audio", "text/plain")}
        )
        assert r.status_code == 415 and "WAV/FLAC/OGG" in r.json()["error"], r.text
        short = io.BytesIO()  # a complete 100-byte WAV: 28 samples, 3.5 ms
        with wave.open(short, "wb") as w:
            w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000), w.writeframes(b"\x10\x00" * 28)
        assert len(short.getvalue()) == 100
        r = srv.client.post("/v1/asr/transcribe", files={"file": ("a.wav", short.getvalue(), "audio/wav")})
        assert r.status_code == 422 and "audio too short" in r.json()["error"], r.text
        assert "Assertion" not in r.text and "Traceback" not in r.text
    finally:
        srv.stop()
