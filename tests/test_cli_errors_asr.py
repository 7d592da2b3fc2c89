"""Bad input to ``mariana asr ...``: one line ``mariana: error: ...`` naming what is wrong, exit 2, no
traceback (issue 21). One table of (argv, exit code, stderr fragments), run through the CLI in this
process (`cliwalk.cli`; the exit code as a process sees it is tested in test_cli_errors.py) on tiny inputs: WAVs written with the `wave` module, a 20-file FSDD folder, and an untrained exported model."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest
from cliwalk import cli
from helpers import assert_cli_error


def _write_wav(path: Path, samples: int, sr: int = 8000) -> Path:
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sr)
        f.writeframes((np.random.default_rng(0).standard_normal(samples) * 3000).astype("<i2").tobytes())
    return path


@pytest.fixture(scope="module")
def inputs(data_dir, tmp_path_factory) -> dict[str, Path]:
    """Tiny inputs: ok.wav (0.5 s), short.wav (100 bytes), cut.wav (audio cut short of its header),
    header.wav (header cut off), an FSDD folder of two speakers, a model run (untrained, exported as
    `mariana asr train` exports), an empty Kaldi dir."""
    import torch
    from mariana.apps.asr.cmvn import FilePrior
    from mariana.apps.asr.configs import PRESETS
    from mariana.apps.asr.features import FeatureSettings, fbank, load_audio
    from mariana.apps.asr.model import build_model
    from mariana.apps.asr.train import BLANK
    from mariana.platform.core.export import export_model

    d = tmp_path_factory.mktemp("asr-bad")
    ok = _write_wav(d / "ok.wav", 4000)
    short = _write_wav(d / "short.wav", 28)
    assert short.stat().st_size == 100
    full = ok.read_bytes()
    (d / "cut.wav").write_bytes(full[: 44 + 1000])
    (d / "header.wav").write_bytes(full[:30])
    fsdd = d / "fsdd"
    fsdd.mkdir()
    for spk in ("george", "lucas"):
        for digit in range(10):
            name = f"{digit}_{spk}_0.wav"
            (fsdd / name).symlink_to(data_dir / "fsdd/recordings" / name)
    (d / "a-file").write_text("x")
    kaldi = d / "kaldi"
    kaldi.mkdir()

    import dataclasses

    cfg = dataclasses.asdict(PRESETS["debug"])
    vocab = [BLANK, "one", "two"]
    torch.manual_seed(0)
    model = build_model(cfg, len(vocab))
    feats = fbank(load_audio(fsdd / "1_george_0.wav", FeatureSettings()), FeatureSettings()).numpy()
    s1, s2 = feats.astype(np.float64).sum(0), (feats.astype(np.float64) ** 2).sum(0)
    prior = FilePrior.from_speaker_stats({"george": {"sum": s1, "sumsq": s2, "frames": len(feats)}})
    run = d / "run"
    extra = {"vocab": vocab, "cmvn_prior": prior.to_dict()}
    export_model(run, model.state_dict(), app="asr", arch="dnn-ctc", config=cfg, extra=extra)
    return {"d": d, "ok": ok, "short": short, "fsdd": fsdd, "run": run, "kaldi": kaldi}


CASES = [
    # transcribe: a bad file is skipped with its reason, the others transcribed, exit 2
    # transcribe: each bad file is skipped with its reason, the good one still transcribed, exit 2
    ("transcribe-bad-files", "asr transcribe --model {run} {d}/short.wav {d}/cut.wav {d}/header.wav {d}/nope.wav {d} {ok}", 2,
     ["short.wav: audio too short", "cut.wav: truncated WAV file: its header declares 8000 bytes",
      "header.wav: unreadable audio", "No 'data' chunk", "nope.wav: no such file", "is a directory",
      "transcribed 1 of 6 file(s): 5 failed"]),
    ("transcribe-beam", "asr transcribe --model {run} --beam -1 {ok}", 2, ["--beam must be >= 0"]),
    ("transcribe-no-model", "asr transcribe --model {d}/nothing {ok}", 2, ["--model", "no such file"]),
    # eval
    ("eval-beam", "asr eval --model {run} --data {kaldi} --beam -1", 2, ["--beam must be >= 0"]),
    ("eval-jobs", "asr eval --model {run} --data {kaldi} --jobs 0", 2, ["--jobs must be >= 1"]),
    ("eval-tempo", "asr eval --model {run} --data {kaldi} --tempo 5", 2, ["--tempo must be in [0.5, 2]"]),
    ("eval-cmvn", "asr eval --model {run} --data {kaldi} --cmvn global", 2, ["--cmvn: invalid choice", "'speaker', 'file'"]),
    ("eval-no-wav-scp", "asr eval --model {run} --data {kaldi}", 2, ["no wav.scp"]),
    # train config values, checked before any worker starts
    ("train-sample-rate", "asr train --data {kaldi} --out {d}/r1 --sample-rate 0", 2, ["--sample-rate must be at least 1000 Hz, got 0"]),
    ("train-beam", "asr train --data {kaldi} --out {d}/r2 --beam -1", 2, ["--beam must be >= 0"]),
    # prepare
    ("prepare-test-dev", "asr prepare --data {fsdd} --out {d}/p2 --test-speakers george --dev-speakers lucas", 2, ["no speaker is left"]),
    ("prepare-unknown", "asr prepare --data {fsdd} --out {d}/p3 --test-speakers bob", 2, ["bob not found", "george, lucas"]),
    ("prepare-out-file", "asr prepare --data {fsdd} --out {d}/a-file", 2, ["a-file: exists and is not a folder"]),
    ("prepare-out-proc", "asr prepare --data {fsdd} --out /proc/mariana-x", 2, ["--out /proc/mariana-x: cannot write there"]),
    ("prepare-utterances", "asr prepare --data {fsdd} --out {d}/p4 --utterances 0", 2, ["--utterances must be >= 1"]),
    ("prepare-seed", "asr prepare --data {fsdd} --out {d}/p5 --seed -1", 2, ["--seed must be >= 0"]),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_asr_cli_error(inputs, case, capfd):
    name, argv, code, fragments = case
    proc = cli([a.format(**inputs) for a in argv.split()], capfd)
    assert_cli_error(proc, *fragments, code=code)
    if name == "transcribe-bad-files":  # the good file is still transcribed; no line for a skipped one
        lines = proc.stdout.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{inputs['ok']}\t"), proc.stdout
        assert proc.stderr.count("mariana: error:") == 6, proc.stderr
