"""ASR unit tests: features, splicing, CTC decoding, Kaldi data dirs, corrupt/missing input."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import scipy.fft
import soundfile as sf
import torch
import torchaudio
from helpers import last_line
from mariana.apps.asr.data import read_kaldi_dir, read_wav
from mariana.apps.asr.decode import beam_decode, edit_distance, error_rates, greedy_decode
from mariana.apps.asr.features import FeatureCache, FeatureSettings, cached_features, fbank, perturbations
from mariana.apps.asr.model import AcousticDNN, build_model, pad_edges, splice
from mariana.platform.core.errors import MarianaError
from trained_runs import cli_here


def _fsdd_subset(src: Path, dst: Path, speakers=("george", "lucas"), takes=range(3)) -> Path:
    """A tiny FSDD-layout folder (symlinks to the real recordings)."""
    dst.mkdir(parents=True)
    for spk in speakers:
        for d in range(10):
            for t in takes:
                (dst / f"{d}_{spk}_{t}.wav").symlink_to(src / f"{d}_{spk}_{t}.wav")
    return dst


def test_fbank_equals_torchaudio(data_dir):
    x, sr = read_wav(data_dir / "fsdd/recordings/3_jackson_7.wav")
    s = FeatureSettings()
    ours = fbank(torch.from_numpy(x), s)
    ref = torchaudio.compliance.kaldi.fbank(
        torch.from_numpy(x).unsqueeze(0) * 32768.0,
        num_mel_bins=40,
        sample_frequency=sr,
        frame_length=25.0,
        frame_shift=10.0,
        dither=0.0,
        energy_floor=0.0,
    )
    assert ours.shape == (1 + (len(x) - 200) // 80, 40)
    torch.testing.assert_close(ours, ref)


def test_splice_equals_naive_stacking():
    torch.manual_seed(0)
    b, t, f, c = 3, 9, 4, 2
    feats = torch.randn(b, t, f)
    lengths = torch.tensor([9, 5, 1])
    feats[1, 5:] = 99.0  # padding must never leak into an utterance's windows
    feats[2, 1:] = 99.0
    out = splice(feats, c, lengths)
    assert out.shape == (b, t, (2 * c + 1) * f)
    for i in range(b):
        n = int(lengths[i])
        for j in range(n):
            naive = torch.cat([feats[i, min(max(j + k, 0), n - 1)] for k in range(-c, c + 1)])
            torch.testing.assert_close(out[i, j], naive)
    # The model splices the same way: its first layer sees (2c+1)*F inputs.
    m = AcousticDNN(num_bins=f, context=c, hidden=8, layers=1, output_units=5)
    assert m(feats, lengths).shape == (b, t, 5)


def test_splice_gather_equals_padded_window_everywhere():
    # splice is one gather through a cached window index; it must give exactly what padding the edges
    # (`pad_edges`) and sliding a window gives, padding positions and empty utterances included.
    torch.manual_seed(0)
    for t, c in [(1, 3), (7, 1), (20, 5), (33, 30)]:
        feats = torch.randn(4, t, 3)
        for lengths in (torch.tensor([t, max(1, t // 2), 1, 0]), None):
            win = pad_edges(feats, c, lengths).unfold(1, 2 * c + 1, 1)
            ref = win.transpose(2, 3).reshape(4, t, (2 * c + 1) * 3)
            assert torch.equal(splice(feats, c, lengths), ref), (t, c, lengths)


def _posteriors(path: list[int], v: int = 4, p: float = 0.9) -> torch.Tensor:
    lp = torch.full((len(path), v), (1 - p) / (v - 1))
    lp[torch.arange(len(path)), torch.tensor(path)] = p
    return lp.log()


def test_ctc_greedy_decoding():
    # blank=0; "1 1 0 1 2 2 0 0 3" -> 1 1 2 3 (a blank separates the repeated 1s)
    lp = _posteriors([1, 1, 0, 1, 2, 2, 0, 0, 3])
    assert greedy_decode(lp) == [1, 1, 2, 3]
    assert greedy_decode(lp, length=4) == [1, 1]
    assert greedy_decode(_posteriors([0, 0, 0])) == []


def test_ctc_beam_beats_greedy_on_summed_paths():
    # Two frames. Best single path is "blank blank" (0.36) -> empty; but the label "1" summed over its
    # paths (1 1, 1 blank, blank 1) has 0.4*0.4 + 0.4*0.6 + 0.6*0.4 = 0.64 -> the beam finds [1].
    probs = torch.tensor([[0.6, 0.4, 0.0], [0.6, 0.4, 0.0]]).clamp_min(1e-9)
    lp = probs.log()
    assert greedy_decode(lp) == []
    assert beam_decode(lp, beam=4) == [1]
    # On peaky posteriors the beam agrees with greedy.
    lp2 = _posteriors([1, 1, 0, 1, 2, 2, 0, 0, 3])
    assert beam_decode(lp2, beam=4) == [1, 1, 2, 3]
    # Beam probability of a sequence equals the brute-force sum over its alignments.
    torch.manual_seed(1)
    lp3 = torch.log_softmax(torch.randn(4, 3), -1)
    best = beam_decode(lp3, beam=50, prune=-math.inf)
    totals: dict[tuple, float] = {}
    import itertools

    for path in itertools.product(range(3), repeat=4):
        seq = tuple(greedy_decode(_onehot(path, 3)))
        totals[seq] = totals.get(seq, 0.0) + math.exp(sum(float(lp3[t, k]) for t, k in enumerate(path)))
    assert tuple(best) == max(totals, key=totals.get)


def _onehot(path, v):
    lp = torch.full((len(path), v), -1e9)
    lp[torch.arange(len(path)), torch.tensor(path)] = 0.0
    return lp


def test_error_rates():
    assert edit_distance("a b c".split(), "a c".split()) == 1
    r = error_rates([["one", "two"], ["three"]], [["one", "two"], ["four", "five"]])
    assert r["wer"] == pytest.approx(200 / 3) and r["ser"] == 50.0 and r["utterances"] == 2


def test_kaldi_dir_round_trip(data_dir, tmp_path):
    src = _fsdd_subset(data_dir / "fsdd/recordings", tmp_path / "fsdd")
    r = cli_here(
        [
            "asr",
            "prepare",
            "--data",
            src,
            "--out",
            tmp_path / "a",
            "--test-speakers",
            "lucas",
            "--utterances",
            "6",
            "--max-digits",
            "3",
            "--seed",
            "3",
        ],
        check=True,
    )
    assert last_line(r.stdout) == "prepared {}: train 6 dev 0 test 6 utterances, skipped 0".format(
        tmp_path / "a"
    )
    a = read_kaldi_dir(tmp_path / "a" / "test")
    assert {u.spk for u in a} == {"lucas"} and all(1 <= len(u.words) <= 3 for u in a)
    assert {u.spk for u in read_kaldi_dir(tmp_path / "a" / "train")} == {"george"}
    # Pauses are low-level noise, not digital silence.
    x, sr = read_wav(a[0].path)
    assert sr == 8000 and np.count_nonzero(x[:400]) > 0
    # The test dir (a Kaldi data dir) read back as input gives the same utterances and audio.
    cli_here(
        [
            "asr",
            "prepare",
            "--data",
            tmp_path / "a" / "test",
            "--out",
            tmp_path / "b",
            "--test-speakers",
            "lucas",
        ],
        check=True,
    )
    for name in ("text", "utt2spk", "spk2utt"):
        assert (tmp_path / "a/test" / name).read_text() == (tmp_path / "b/test" / name).read_text()
    b = read_kaldi_dir(tmp_path / "b" / "test")
    assert [u.utt for u in a] == [u.utt for u in b]
    for ua, ub in zip(a, b):
        np.testing.assert_array_equal(read_wav(ua.path)[0], read_wav(ub.path)[0])
    assert (tmp_path / "b/train/wav.scp").read_text() == ""  # a test-only input is allowed


def test_piped_wav_scp_rejected(tmp_path):
    d = tmp_path / "k"
    d.mkdir()
    (d / "wav.scp").write_text("u1 sox a.wav -t wav - |\n")
    (d / "text").write_text("u1 one\n")
    (d / "utt2spk").write_text("u1 s1\n")
    with pytest.raises(MarianaError, match=r"wav.scp line 1: piped entry"):
        read_kaldi_dir(d)


def test_corrupt_wav_is_skipped_and_counted(data_dir, tmp_path):
    src = _fsdd_subset(data_dir / "fsdd/recordings", tmp_path / "fsdd", takes=range(2))
    bad = src / "5_george_9.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00WAVEfmt garbage")
    r = cli_here(
        [
            "asr",
            "prepare",
            "--data",
            src,
            "--out",
            tmp_path / "o",
            "--test-speakers",
            "lucas",
            "--utterances",
            "4",
        ],
        check=True,
    )
    assert f"mariana: warning: skipped 1 unreadable recording in {src} (first: {bad}: " in r.stderr
    assert last_line(r.stdout).endswith("skipped 1")
    # The feature cache skips and records an unreadable file of a Kaldi dir too.
    test = tmp_path / "o" / "test"
    first = (test / "wav.scp").read_text().splitlines()[0].split()[1]
    Path(first).write_bytes(b"not a wav at all")
    cache = cached_features(test, FeatureSettings(), jobs=2)
    assert len(cache) == 3 and [s["path"] for s in cache.skipped] == [first]
    reopened = FeatureCache(cache.folder)
    assert reopened.feats(0).dtype == torch.float32 and reopened.feats(0).shape[1] == 40
    # Per-speaker CMVN: the speaker's frames have zero mean and unit variance per bin (up to fp16).
    allf = torch.cat([reopened.feats(i) for i in range(len(reopened))])
    torch.testing.assert_close(allf.mean(0), torch.zeros(40), atol=2e-3, rtol=0)
    torch.testing.assert_close(allf.std(0, unbiased=False), torch.ones(40), atol=2e-3, rtol=0)


def test_missing_directory_clear_error(tmp_path):
    r = cli_here(["asr", "prepare", "--data", tmp_path / "nope", "--out", tmp_path / "o"])
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("mariana: error:") and "nope" in lines[0]
    r = cli_here(["asr", "eval", "--model", tmp_path / "norun", "--data", tmp_path])
    assert r.returncode == 2 and "Traceback" not in r.stderr and "norun" in r.stderr


def test_wav_roundtrip_float(tmp_path):
    x = (np.sin(np.arange(800) / 5) * 0.5).astype(np.float32)
    sf.write(tmp_path / "a.wav", x, 8000, subtype="PCM_16")
    y, sr = read_wav(tmp_path / "a.wav")
    assert sr == 8000 and np.abs(x - y).max() < 1e-4


def test_mfcc_and_vtln_warped_copies_equal_torchaudio(data_dir, tmp_path):
    x, sr = read_wav(data_dir / "fsdd/recordings/3_jackson_7.wav")
    wav = torch.from_numpy(x).unsqueeze(0) * 32768.0
    kw = dict(sample_frequency=sr, frame_length=25.0, frame_shift=10.0, dither=0.0, energy_floor=0.0)
    s = FeatureSettings(num_mel_bins=23, kind="mfcc", num_ceps=13)
    ref = torchaudio.compliance.kaldi.mfcc(wav, num_mel_bins=23, num_ceps=13, vtln_warp=0.9, **kw)
    torch.testing.assert_close(fbank(torch.from_numpy(x), s, warp=0.9), ref)
    warped = fbank(torch.from_numpy(x), FeatureSettings(), warp=1.1)
    torch.testing.assert_close(
        warped, torchaudio.compliance.kaldi.fbank(wav, num_mel_bins=40, vtln_warp=1.1, **kw)
    )
    assert not torch.allclose(warped, fbank(torch.from_numpy(x), FeatureSettings()))

    # Copies: every speed unwarped, then every warp at speed 1, each its own CMVN "speaker".
    assert perturbations((0.9, 1.0), (1.0, 1.1)) == [(0.9, 1.0, 1.0), (1.0, 1.0, 1.0), (1.0, 1.1, 1.0)]
    assert perturbations((1.0,), (1.0,), (1.0, 1.2)) == [(1.0, 1.0, 1.0), (1.0, 1.0, 1.2)]
    d = tmp_path / "k"
    d.mkdir()
    p = data_dir / "fsdd/recordings/3_jackson_7.wav"
    (d / "wav.scp").write_text(f"u1 {p}\n")
    (d / "text").write_text("u1 three\n")
    (d / "utt2spk").write_text("u1 jackson\n")
    cache = cached_features(d, s, jobs=1, copies=perturbations((0.9, 1.0), (1.1,)))
    assert [(u["utt"], u["spk"]) for u in cache.utts] == [
        ("sp0.9-u1", "sp0.9-jackson"),
        ("u1", "jackson"),
        ("vtln1.1-u1", "vtln1.1-jackson"),
    ]
    fb = cached_features(d, FeatureSettings(), jobs=1, copies=perturbations(warps=(1.1,), pitches=(0.9,)))
    assert [(u["utt"], u["spk"], u["frames"]) for u in fb.utts] == [
        ("u1", "jackson", fb.utts[0]["frames"]),
        ("vtln1.1-u1", "vtln1.1-jackson", fb.utts[0]["frames"]),
        ("pitch0.9-u1", "pitch0.9-jackson", fb.utts[0]["frames"]),
    ]
    assert cache.feats(0).shape[1] == 13 and cache.feats(0).shape[0] > cache.feats(1).shape[0]
    # The model's input width follows the feature kind.
    cfg = {"num_mel_bins": 23, "features": "mfcc", "num_ceps": 13, "context": 2, "hidden": 8, "layers": 1}
    cfg |= {"activation": "relu", "dropout": 0.0, "norm": "none"}
    assert build_model(cfg, 11).body[0].in_features == 13 * 5


def _voice(f0: float, sr: int = 8000, seconds: float = 0.5) -> np.ndarray:
    """A steady vowel: harmonics of f0 under one fixed envelope (formants at 700 and 1800 Hz)."""
    t = np.arange(int(seconds * sr)) / sr
    x = sum(
        (np.exp(-((((k * f0) - 700) / 250) ** 2)) + 0.6 * np.exp(-((((k * f0) - 1800) / 300) ** 2)) + 0.05)
        * np.sin(2 * np.pi * k * f0 * t)
        for k in range(1, int(3800 / f0))
    )
    return (0.3 * x / np.abs(x).max()).astype(np.float32)


@pytest.mark.parametrize("pitch", [0.8, 1.25])
def test_pitch_copy_moves_the_harmonics_and_keeps_the_envelope(tmp_path, pitch):
    from mariana.apps.asr.features import (
        ENVELOPE_CEPS,
        copy_features,
        load_audio,
        mel_centres,
        pitch_settings,
        swap_envelope,
    )

    s = FeatureSettings()
    sf.write(tmp_path / "a.wav", _voice(120.0), 8000)
    sf.write(tmp_path / "b.wav", _voice(120.0 * pitch), 8000)  # the same vowel spoken at the new pitch
    a, b = copy_features(tmp_path / "a.wav", s), copy_features(tmp_path / "b.wav", s)
    shifted = copy_features(tmp_path / "a.wav", s, pitch=pitch)
    sped = copy_features(tmp_path / "a.wav", s, speed=pitch)  # what speed perturbation gives instead
    assert shifted.shape == a.shape  # tempo kept: frame for frame the original's
    low = mel_centres(s) < 1000  # where the filters resolve harmonics of a 100-150 Hz voice

    def spectrum(x):  # the steady part's mean log-mel, level removed
        m = x[3:-3].mean(0)
        return m - m.mean()

    def dist(x, y, bins=slice(None)):
        return float((spectrum(x)[bins] - spectrum(y)[bins]).pow(2).mean().sqrt())

    # The harmonics land where the vowel at the new pitch has them ...
    assert dist(shifted, b, low) < 0.75 * dist(a, b, low)
    # ... while the envelope stays the original's: speed perturbation moves the formants and is far off.
    assert dist(shifted, b) < 0.5 * dist(sped, b)
    # Filters above the copy's band (0.9 x Nyquist, x pitch when lowered) keep the original frame; the
    # others are the envelope swap: the resampled copy's frames with the original's first cepstra.
    inside = mel_centres(s) < 0.9 * 4000 * min(1.0, pitch)
    assert 0 < int((~inside).sum()) < 10
    torch.testing.assert_close(shifted[:, ~inside], a[:, ~inside])
    ripple = fbank(load_audio(tmp_path / "a.wav", s, pitch), pitch_settings(s, pitch))
    swapped = swap_envelope(a, ripple)
    torch.testing.assert_close(shifted[:, inside], swapped[:, inside])

    def cepstra(x):
        return torch.from_numpy(scipy.fft.dct(x.double().numpy(), norm="ortho", axis=1))

    n = min(len(a), len(ripple))  # the ripple's frames may run one past the original's
    fp32 = dict(rtol=0, atol=1e-4)  # the swap returns float32 log energies
    torch.testing.assert_close(cepstra(swapped)[:, :ENVELOPE_CEPS], cepstra(a)[:, :ENVELOPE_CEPS], **fp32)
    torch.testing.assert_close(
        cepstra(swapped)[:n, ENVELOPE_CEPS:], cepstra(ripple)[:n, ENVELOPE_CEPS:], **fp32
    )
    with pytest.raises(MarianaError, match="pitch perturbation needs filterbank"):
        copy_features(tmp_path / "a.wav", FeatureSettings(kind="mfcc"), pitch=pitch)


def test_time_stretch_resamples_each_utterance_on_the_frame_axis():
    from mariana.apps.asr.train import time_stretch

    torch.manual_seed(0)
    feats = torch.randn(3, 12, 4)
    lengths = torch.tensor([12, 7, 1])
    feats[1, 7:] = 99.0  # padding must never leak into a stretched utterance
    feats[2, 1:] = 99.0
    same, n = time_stretch(feats, lengths, 1.0, 1.0)
    assert n.tolist() == [12, 7, 1]
    for i in range(3):
        torch.testing.assert_close(same[i, : n[i]], feats[i, : n[i]])
    # Twice as slow: twice the frames; even output frames are the input frames, odd ones their midpoints.
    slow, n = time_stretch(feats, lengths, 2.0, 2.0)
    assert n.tolist() == [24, 14, 2]
    for i, length in enumerate([12, 7, 1]):
        x = feats[i, :length]
        nxt = torch.cat([x[1:], x[-1:]])  # the last frame holds at the right edge
        torch.testing.assert_close(slow[i, 0 : 2 * length : 2], x)
        torch.testing.assert_close(slow[i, 1 : 2 * length : 2], (x + nxt) / 2)
        assert (slow[i, 2 * length :] == 0).all()
    # Twice as fast: every other frame.
    fast, n = time_stretch(feats, lengths, 0.5, 0.5)
    assert n.tolist() == [6, 3, 1]
    torch.testing.assert_close(fast[0, :6], feats[0, 0:12:2])
    torch.testing.assert_close(fast[1, :3], feats[1, 0:7:2][:3])
    # Random per-segment factors: lengths within the factor range, frames interpolate the input (monotone
    # positions: a ramp stays a non-decreasing ramp) and never reach into the padding.
    ramp = torch.arange(40.0).reshape(1, 40, 1).repeat(2, 1, 1)
    out, n = time_stretch(ramp, torch.tensor([40, 25]), 0.7, 1.4, segment=5)
    for i, length in enumerate([40, 25]):
        assert 0.7 * length - 1 <= n[i] <= 1.4 * length
        v = out[i, : n[i], 0]
        assert v[0] == 0 and (v.diff() >= 0).all() and v.max() <= length - 1


def test_peak_posteriors_average_the_firing_frames_only():
    from mariana.apps.asr.evaluate import peak_posteriors

    # Frames 0 and 3 are blank-best and do not count; frames 1, 2 fire words with 0.9 and 0.6.
    p = torch.tensor([[0.8, 0.1, 0.1], [0.05, 0.9, 0.05], [0.2, 0.2, 0.6], [0.7, 0.2, 0.1]])
    total, n = peak_posteriors(p.log())
    assert n == 2 and total == pytest.approx(1.5)
    assert peak_posteriors(torch.tensor([[0.9, 0.1]]).log()) == (0.0, 0)


def test_pitch_perturb_flag_is_checked():
    from mariana.apps.asr.configs import AsrConfig

    AsrConfig(pitch_perturb=[0.85, 1.2]).validate()
    with pytest.raises(MarianaError, match=r"--pitch-perturb factors must be in \[0.7, 1.3\]"):
        AsrConfig(pitch_perturb=[1.5]).validate()
    with pytest.raises(MarianaError, match="--pitch-perturb needs --features fbank"):
        AsrConfig(pitch_perturb=[0.9], features="mfcc").validate()
