"""`mariana asr synth`: eSpeak NG speakers, deterministic from a seed, cached; bad files skipped and counted;
`prepare --synth` mixes them into the training split only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from helpers import DATA, assert_cli_error, last_line
from mariana.apps.asr import synth
from mariana.apps.asr.data import DIGIT_WORDS, prepare, read_kaldi_dir, read_wav, synth_counts
from trained_runs import cli_here

FSDD = DATA / "fsdd" / "recordings"


def _wavs(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.wav"))}


def test_same_seed_same_files_other_seed_other_voices(tmp_path):
    a = synth.synthesize(tmp_path / "a", speakers=3, takes=2, seed=5, progress=False)
    synth.synthesize(tmp_path / "b", speakers=3, takes=2, seed=5, progress=False)
    assert (a.files, a.generated, a.skipped) == (60, 60, [])
    wa, wb = _wavs(tmp_path / "a"), _wavs(tmp_path / "b")
    assert len(wa) == 60 and wa == wb  # byte-identical
    c = synth.synthesize(tmp_path / "c", speakers=3, takes=2, seed=6, progress=False)
    assert c.files == 60
    va = json.loads((tmp_path / "a" / "synth.json").read_text())["speakers"]
    vc = json.loads((tmp_path / "c" / "synth.json").read_text())["speakers"]
    assert [(s["accent"], s["variant"], s["pitch"]) for s in va] != [
        (s["accent"], s["variant"], s["pitch"]) for s in vc
    ]
    # Every file is a spoken digit: 8 kHz mono, between a tenth of a second and two seconds.
    for name in wa:
        x, sr = read_wav(tmp_path / "a" / name)
        assert sr == 8000 and 0.1 < len(x) / sr < 2.0, name
    # Takes of one voice differ (jittered rate/pitch), so they are not copies.
    assert wa["3_tts5x0000_0.wav"] != wa["3_tts5x0000_1.wav"]


def test_cache_keeps_good_files_and_regenerates_bad_ones(tmp_path):
    out = tmp_path / "s"
    synth.synthesize(out, speakers=2, takes=2, seed=0, progress=False)
    before = _wavs(out)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.wav")}
    r = synth.synthesize(out, speakers=2, takes=2, seed=0, progress=False)
    assert (r.generated, r.regenerated, r.files) == (0, 0, 40)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.wav")} == mtimes
    # A truncated file (header declares more audio than it holds) and an empty one are written again,
    # counted, and come back byte-identical.
    cut, empty = out / "4_tts0x0001_1.wav", out / "7_tts0x0000_0.wav"
    cut.write_bytes(before[cut.name][: len(before[cut.name]) // 2])
    empty.write_bytes(b"")
    r = synth.synthesize(out, speakers=2, takes=2, seed=0, progress=False)
    assert (r.generated, r.regenerated, r.files) == (2, 2, 40)
    assert _wavs(out) == before
    # Another seed in the same folder starts afresh rather than mixing two recipes.
    r = synth.synthesize(out, speakers=2, takes=2, seed=1, progress=False)
    assert r.generated == 40 and not list(out.glob("*_tts0x*.wav"))


def test_no_audio_from_the_engine_is_skipped_and_counted(tmp_path, monkeypatch):
    # In this process (synthesize runs speakers in child processes, where a monkeypatch cannot reach).
    real = synth.Espeak.speak

    def speak(self, text, *a):
        return np.zeros(0, np.int16) if text == "seven" else real(self, text, *a)

    monkeypatch.setattr(synth.Espeak, "speak", speak)
    spk = synth.draw_speakers(1, 0)[0]
    out = tmp_path / "s"
    out.mkdir()
    names = {p.name for _, _, p in synth.speaker_files(out, spk, 2)}
    written, skipped = synth.synth_speaker(out, spk, 2, 0, 8000, names)
    assert written == 18 and len(skipped) == 2
    assert all("'seven'" in reason for _, reason in skipped)
    assert not list(out.glob("7_*.wav")) and len(list(out.glob("*.wav"))) == 18


def test_prepare_mixes_synthetic_speakers_into_training_only(tmp_path):
    s = tmp_path / "synth"
    synth.synthesize(s, speakers=4, takes=2, seed=0, progress=False)
    # One corrupt and one empty synthetic file: prepare skips and counts them like bad recordings.
    (s / "2_tts0x0003_0.wav").write_bytes(b"RIFF....WAVEjunk")
    (s / "5_tts0x0002_1.wav").write_bytes(b"")
    base = prepare(FSDD, tmp_path / "base", ["jackson"], [], utterances=6, max_digits=3, seed=0)
    r = prepare(
        FSDD, tmp_path / "mix", ["jackson"], [], utterances=6, max_digits=3, seed=0, synth=s, synth_ratio=0.5
    )
    assert base.skipped == [] and sorted(Path(p).name for p, _ in r.skipped) == [
        "2_tts0x0003_0.wav",
        "5_tts0x0002_1.wav",
    ]
    train = read_kaldi_dir(tmp_path / "mix" / "train")
    synth_utts = [u for u in train if u.spk.startswith("tts")]
    # 0.5 x (4 real training speakers x 6) = 12 synthetic utterances, 3 for each of the 4 voices.
    assert len(synth_utts) == 12 and len({u.spk for u in synth_utts}) == 4
    assert all(w in DIGIT_WORDS for u in synth_utts for w in u.words)
    assert {u.spk for u in read_kaldi_dir(tmp_path / "mix" / "test")} == {"jackson"}
    # The real utterances are the same with or without the synthetic speakers.
    real_mix = {u.utt: u.words for u in train if not u.spk.startswith("tts")}
    assert real_mix == {u.utt: u.words for u in read_kaldi_dir(tmp_path / "base" / "train")}
    # The ratio is kept below one utterance per voice too: round(0.1 x 24) = 2 utterances from 2 voices.
    prepare(
        FSDD, tmp_path / "few", ["jackson"], [], utterances=6, max_digits=3, seed=0, synth=s, synth_ratio=0.1
    )
    few = [u.spk for u in read_kaldi_dir(tmp_path / "few" / "train") if u.spk.startswith("tts")]
    assert sorted(few) == ["tts0x0000", "tts0x0002"]


def test_synth_counts_share_the_total_evenly():
    voices = [f"v{i}" for i in range(8)]
    for total in (0, 3, 8, 13, 24):
        counts = synth_counts(voices, total)
        assert sum(counts.values()) == total and max(counts.values()) - min(counts.values()) <= (
            total % 8 > 0
        )
    assert [k for k, n in synth_counts(voices, 2).items() if n] == ["v0", "v4"]  # spread, not the first two


def test_cli_synth_and_bad_flags(tmp_path):
    p = cli_here(["asr", "synth", "--out", tmp_path / "o", "--speakers", "1", "--takes", "1"], check=True)
    assert last_line(p.stdout).startswith("synthesised ") and "10 files" in p.stdout
    assert_cli_error(cli_here(["asr", "synth", "--out", tmp_path / "o", "--speakers", "0"]),
                     "--speakers and --takes must be >= 1")  # fmt: skip
    assert_cli_error(
        cli_here(
            ["asr", "prepare", "--data", FSDD, "--out", tmp_path / "x", "--synth", tmp_path / "missing"]
        ),
        "no such folder",
    )
