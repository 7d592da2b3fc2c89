"""`mariana asr eval --vtln FACTOR|auto`: test-time vocal-tract-length normalisation per speaker (issue 20).
A tiny model trained once through the CLI (jackson and george held out); every check compares `eval` with
features, posteriors and the confidence criterion recomputed here from `features.fbank(warp=)`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import last_line
from mariana.apps.asr.cmvn import apply_cmvn
from mariana.apps.asr.data import read_kaldi_dir
from mariana.apps.asr.decode import decode_options, error_rates
from mariana.apps.asr.evaluate import VTLN_GRID, evaluate_run, load_model
from mariana.apps.asr.features import FeatureCache, fbank, feature_settings, load_audio
from mariana.platform.core.errors import MarianaError
from trained_runs import cli_here, train

HELD_OUT = ("george", "jackson")


@pytest.fixture(scope="module")
def tiny(data_dir, tmp_path_factory):
    """(run dir, test data dir): the debug preset trained on lucas/nicolas/yweweler (20 utterances of 1..2
    digits each), enough for the model to fire words on the held-out speakers."""
    d = tmp_path_factory.mktemp("asr-vtln")
    # made in this process (`trained_runs.train`: no interpreter start-up); the tests read them (and one
    # adds pitch-perturbed features to the data's cache, as before)
    data = train(
        ["asr", "prepare", "--data", data_dir / "fsdd/recordings"]
        + ["--test-speakers", ",".join(HELD_OUT), "--utterances", "20", "--max-digits", "2"],
        d / "data",
    ).path
    run = train(
        ["asr", "train", "--data", data, "--preset", "debug", "--epochs", "20", "--lr", "3e-3"]
        + ["--hidden", "128", "--context", "10", "--no-progress"],
        d / "run",
    ).path
    return run, data / "test"


def _reference(run, test, warp: float):
    """Computed without the eval path: {utt: (speaker, CMVN'd features [T, 40] rounded to fp16 as the
    cache stores them, log posteriors [T, V])} for every test utterance at ``warp``."""
    model, vocab, cfg = load_model(run)
    s = feature_settings(cfg)
    utts = read_kaldi_dir(test)
    raw = [fbank(load_audio(u.path, s), s, warp).numpy() for u in utts]
    feats = apply_cmvn(raw, [u.spk for u in utts])  # each speaker's statistics of its warped features
    out = {}
    with torch.no_grad():
        for u, f in zip(utts, feats):
            x = torch.from_numpy(np.asarray(f, dtype=np.float16).astype(np.float32))
            logp = model(x[None], torch.tensor([len(x)]))[0, :, : len(vocab)]
            out[u.utt] = (u.spk, x, logp)
    return out


def _confidence(ref) -> dict[str, float]:
    """{speaker: mean over the frames whose best unit is a word (not blank, id 0) of that unit's
    posterior}, the --vtln auto criterion written out independently."""
    acc: dict[str, list[float]] = {}
    for spk, _, logp in ref.values():
        p = logp.exp()
        best, unit = p.max(-1)
        a = acc.setdefault(spk, [0.0, 0])
        a[0] += float(best[unit != 0].double().sum())
        a[1] += int((unit != 0).sum())
    return {spk: total / max(n, 1) for spk, (total, n) in acc.items()}


def test_vtln_1_is_plain_eval(tiny):
    run, test = tiny
    e = cli_here(["asr", "eval", "--model", run, "--data", test], check=True)
    plain = json.loads((run / "eval" / "test.json").read_text())
    assert plain["vtln"] == 1.0 and plain["speaker_vtln"] == dict.fromkeys(HELD_OUT, 1.0)
    assert "vtln 1.0 (george=1 jackson=1)" in e.stdout
    one = evaluate_run(str(run), str(test), vtln="1.0")
    assert one["hypotheses"] == plain["hypotheses"] and one["wer"] == plain["wer"]
    assert (
        sum(bool(h) for h in one["hypotheses"].values()) >= 10
    )  # the model fires: the criterion means something


def test_fixed_warp_uses_warped_features(tiny):
    run, test = tiny
    r = evaluate_run(str(run), str(test), vtln=0.9)
    assert r["vtln"] == 0.9 and r["speaker_vtln"] == dict.fromkeys(HELD_OUT, 0.9)
    ref = _reference(run, test, 0.9)
    assert set(r["hypotheses"]) == set(ref)  # original utterance ids, not vtln0.9-<utt>

    # The cache eval built: warped copies only, each speaker normalised over its own warped features.
    caches = [FeatureCache(p.parent) for p in (run / "feats").glob("*/index.json")]
    frames = sorted(len(x) for _, x, _ in ref.values())  # 10 ms frames (other tests add other tempos)
    (warped,) = [c for c in caches if c.utts[0]["utt"].startswith("vtln0.9-") and sorted(c.lengths) == frames]
    assert {u["spk"] for u in warped.utts} == {f"vtln0.9-{s}" for s in HELD_OUT}
    for i, u in enumerate(warped.utts):
        _, x, _ = ref[u["utt"].removeprefix("vtln0.9-")]
        torch.testing.assert_close(warped.feats(i), x, atol=2e-3, rtol=2e-3)
    plain = _reference(run, test, 1.0)
    for u in ref:  # the warp changed the features
        assert not torch.allclose(ref[u][1], plain[u][1], atol=0.05)

    # The hypotheses are those of the reference features through the run's decoder.
    model, vocab, cfg, meta = load_model(run, with_meta=True)
    opts = decode_options(str(run), cfg, meta, None, None, None)
    hyps = {u: " ".join(vocab[k] for k in opts.decode(logp)) for u, (_, _, logp) in ref.items()}
    assert hyps == r["hypotheses"]


def test_auto_picks_the_most_confident_warp_per_speaker(tiny):
    run, test = tiny
    auto = evaluate_run(str(run), str(test), vtln="auto")
    assert auto["vtln"] == "auto" and set(auto["speaker_vtln"]) == set(HELD_OUT)
    conf = {w: _confidence(_reference(run, test, w)) for w in VTLN_GRID}
    for spk in HELD_OUT:
        per = {w: conf[w][spk] for w in VTLN_GRID}
        best = max(per.values())
        chosen = auto["speaker_vtln"][spk]
        assert chosen in VTLN_GRID and per[chosen] == pytest.approx(best, abs=1e-5), (spk, per)
        near = [w for w in VTLN_GRID if per[w] > best - 1e-5]  # equal up to float summation order
        assert chosen in near, (spk, per)

    # ... and scores each speaker exactly as a fixed --vtln of its warp does.
    spk_of = _utt2spk(test)
    expected = {}
    for w in set(auto["speaker_vtln"].values()):
        fixed = evaluate_run(str(run), str(test), vtln=w)["hypotheses"]
        expected.update({u: h for u, h in fixed.items() if auto["speaker_vtln"][spk_of[u]] == w})
    assert auto["hypotheses"] == expected
    refs = {u.utt: u.words for u in read_kaldi_dir(test)}
    r = error_rates([refs[u] for u in sorted(expected)], [expected[u].split() for u in sorted(expected)])
    assert auto["wer"] == pytest.approx(r["wer"])
    print(f"--vtln auto: {auto['speaker_vtln']} WER {auto['wer']:.2f}%")


def _utt2spk(test) -> dict[str, str]:
    return dict(line.split() for line in (test / "utt2spk").read_text().splitlines())


def test_tempo_auto_then_vtln_auto(tiny):
    """Both auto: the tempo chosen at warp 1 (as --tempo auto alone), then the warp at that tempo."""
    run, test = tiny
    spk_of = _utt2spk(test)
    tempo_only = evaluate_run(str(run), str(test), tempo="auto")
    both = evaluate_run(str(run), str(test), tempo="auto", vtln="auto")
    assert both["speaker_tempo"] == tempo_only["speaker_tempo"]
    for spk in HELD_OUT:
        t = both["speaker_tempo"][spk]
        at_t = evaluate_run(str(run), str(test), tempo=t, vtln="auto")
        assert at_t["speaker_vtln"][spk] == both["speaker_vtln"][spk]
        fixed = evaluate_run(str(run), str(test), tempo=t, vtln=both["speaker_vtln"][spk])["hypotheses"]
        mine = {u for u in fixed if spk_of[u] == spk}
        assert {u: both["hypotheses"][u] for u in mine} == {u: fixed[u] for u in mine}


def test_loso_passes_vtln_through(tiny, data_dir, tmp_path, monkeypatch):
    """eval --loso hands --vtln to every fold's eval and records it (training replaced by a copy of the
    tiny run: only the pass-through is under test)."""
    from mariana.apps.asr import loso

    run, _ = tiny
    monkeypatch.setattr(
        loso, "run_train", lambda fold, data, run_dir, args, log: shutil.copytree(run, run_dir)
    )
    r = loso.run_loso(
        str(data_dir / "fsdd/recordings"), str(tmp_path), "jackson", utterances=6, max_digits=2, vtln="0.95"
    )
    assert r["eval"]["vtln"] == "0.95" and r["folds"]["jackson"]["speaker_vtln"] == {"jackson": 0.95}
    assert json.loads((tmp_path / "jackson" / "eval" / "test.json").read_text())["vtln"] == 0.95
    with pytest.raises(MarianaError, match="--vtln must be a number or auto"):
        loso.run_loso(str(data_dir / "fsdd/recordings"), str(tmp_path / "bad"), "jackson", vtln="x")
    assert not (tmp_path / "bad").exists()  # refused before any fold was prepared


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--vtln", "2"], "--vtln must be in [0.7, 1.3] or auto, got 2"),
        (["--vtln", "abc"], "--vtln must be a number or auto, got 'abc'"),
        (["--vtln", "0.9", "--cmvn", "file"], "--vtln needs per-speaker CMVN"),
    ],
)
def test_bad_vtln_values_are_refused(tiny, flags, message):
    run, test = tiny
    e = cli_here(["asr", "eval", "--model", run, "--data", test, *flags])
    assert e.returncode == 2 and message in e.stderr, e.stderr
    assert "Traceback" not in e.stderr and "mariana: error:" in last_line(e.stderr)


def test_train_adds_pitch_copies_of_every_utterance(tiny, tmp_path):
    """`train --pitch-perturb` trains on the original and one copy per factor of every utterance, each copy
    frame for frame as long as its original and its own CMVN speaker."""
    data = Path(tiny[1]).parent
    cli_here(
        ["asr", "train", "--data", data, "--out", tmp_path / "run", "--preset", "debug", "--epochs", "1"]
        + ["--speed-perturb", "1.0", "--pitch-perturb", "0.9,1.1", "--no-progress"],
        check=True,
    )
    caches = [json.loads(p.read_text())["utts"] for p in (data / "train/feats").glob("*/index.json")]
    (utts,) = [c for c in caches if any(u["utt"].startswith("pitch") for u in c)]
    orig = {u["utt"]: u for u in utts if not u["utt"].startswith("pitch")}
    assert len(utts) == 3 * len(orig) > 0
    for tag in ("pitch0.9-", "pitch1.1-"):
        copies = {u["utt"].removeprefix(tag): u for u in utts if u["utt"].startswith(tag)}
        assert copies.keys() == orig.keys()
        for k, u in copies.items():
            assert u["frames"] == orig[k]["frames"] and u["spk"] == tag + orig[k]["spk"]
