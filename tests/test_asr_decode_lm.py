"""Shallow fusion of the training transcripts' word bigram in the CTC prefix beam search (`--lm-weight`,
`--word-bonus`): the bigram's estimate, the search against references computed other ways, and the
eval/transcribe plumbing (old exports without an LM, flags recorded in the result)."""

import itertools
import json
import math

import numpy as np
import pytest
import torch
from cliwalk import cli
from helpers import assert_cli_error
from mariana.apps.asr.decode import BigramLM, beam_decode, decode_options, greedy_decode
from mariana.platform.core.errors import MarianaError

VOCAB = ["<blank>", "one", "two", "three"]


def _lse(a, b):  # the acoustic-only search before fusion existed, kept verbatim as the reference
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    m = max(a, b)
    return m + math.log1p(math.exp(-abs(a - b)))


def _reference_beam_decode(logp, beam=8, length=None, blank=0, prune=-12.0):
    lp = logp[: length if length is not None else logp.shape[0]].double().cpu().numpy()
    beams = {(): (0.0, -math.inf)}
    for t in range(lp.shape[0]):
        row = lp[t]
        cand = np.nonzero(row >= prune)[0].tolist() or [int(row.argmax())]
        nxt = {}

        def add(prefix, pb, pnb, nxt=nxt):
            cur = nxt.setdefault(prefix, [-math.inf, -math.inf])
            cur[0], cur[1] = _lse(cur[0], pb), _lse(cur[1], pnb)

        for prefix, (pb, pnb) in beams.items():
            total = _lse(pb, pnb)
            for k in cand:
                p = float(row[k])
                if k == blank:
                    add(prefix, total + p, -math.inf)
                    continue
                last = prefix[-1] if prefix else None
                if k == last:
                    add(prefix, -math.inf, pnb + p)
                    add(prefix + (k,), -math.inf, pb + p)
                else:
                    add(prefix + (k,), -math.inf, total + p)
        ranked = sorted(nxt.items(), key=lambda kv: _lse(*kv[1]), reverse=True)[:beam]
        beams = {k: (v[0], v[1]) for k, v in ranked}
    return list(max(beams.items(), key=lambda kv: _lse(*kv[1]))[0])


def test_bigram_estimate_is_add_one_over_words_and_end():
    lm = BigramLM.estimate([["one", "two"], ["one", "two"], ["two"], ["one", "four"]], VOCAB)
    p = np.exp(np.array(lm.log_probs))
    np.testing.assert_allclose(p.sum(1), 1.0)  # every history: a distribution over 3 words + </s>
    # "one four" is left out (four is not a unit). Counts: <s>->one 2, <s>->two 1; one->two 2;
    # two-></s> 3. Each row adds 1 to the 4 outcomes (columns: </s>=0, one, two, three).
    np.testing.assert_allclose(p[0], [1 / 7, 3 / 7, 2 / 7, 1 / 7])  # after <s>
    np.testing.assert_allclose(p[1], [1 / 6, 1 / 6, 3 / 6, 1 / 6])  # after "one"
    np.testing.assert_allclose(p[2], [4 / 7, 1 / 7, 1 / 7, 1 / 7])  # after "two"
    np.testing.assert_allclose(p[3], [1 / 4] * 4)  # never seen: uniform
    assert BigramLM.from_dict(lm.to_dict(), VOCAB).log_probs == lm.log_probs
    with pytest.raises(MarianaError, match="vocabulary"):
        BigramLM.from_dict(lm.to_dict(), VOCAB[:3])


def test_no_weight_no_bonus_is_the_acoustic_search_exactly():
    lm = BigramLM.estimate([["one", "two", "three"], ["three"]], VOCAB)
    g = torch.Generator().manual_seed(0)
    for case in range(40):
        t, v = 3 + case % 9, 2 + case % 4
        # Flat-ish posteriors (low temperature would leave one path): many prefixes compete in the beam.
        lp = torch.log_softmax(torch.randn(t, v, generator=g) * (0.5 + case % 3), -1)
        beam, prune = 1 + case % 6, (-12.0, -1.5, -math.inf)[case % 3]
        ref = _reference_beam_decode(lp, beam, prune=prune)
        assert beam_decode(lp, beam, prune=prune) == ref
        if v == len(VOCAB):  # an LM given at weight 0 changes nothing either
            assert beam_decode(lp, beam, prune=prune, lm=lm, lm_weight=0.0, word_bonus=0.0) == ref


def _probs(rows):
    return torch.tensor(rows, dtype=torch.float64).clamp_min(1e-12).log()


def test_a_strong_lm_resolves_ambiguous_acoustics():
    # "one", a pause, then a frame that is "one" or "two" almost equally (blank = unit 0; "two" also gains
    # the alignments where the first "one" lasts two frames, so the frame leans to "one" to tie them).
    lp = _probs(
        [[0.05, 0.9, 0.05, 0.0], [0.9, 0.05, 0.05, 0.0], [0.1, 0.5, 0.4, 0.0], [0.9, 0.05, 0.05, 0.0]]
    )
    assert beam_decode(lp, 8) == [1, 1]  # acoustics alone: "one one"
    lm = BigramLM.estimate([["one", "two"]] * 20, VOCAB)  # "two" always follows "one"
    assert beam_decode(lp, 8, lm=lm, lm_weight=1.0) == [1, 2]
    assert beam_decode(lp, 8, lm=lm, lm_weight=0.01) == [1, 1]  # a weak LM leaves the acoustics be
    # A word bonus alone favours more words, a negative one fewer.
    quiet = _probs([[0.4, 0.6, 0.0, 0.0], [0.9, 0.1, 0.0, 0.0], [0.6, 0.4, 0.0, 0.0]])
    assert beam_decode(quiet, 8) == [1]
    assert beam_decode(quiet, 8, word_bonus=3.0) == [1, 1]
    assert beam_decode(quiet, 8, word_bonus=-20.0) == []


@pytest.mark.parametrize("lm_weight,word_bonus", [(0.7, 0.0), (2.0, -0.5), (0.3, 1.5)])
def test_fused_search_finds_the_brute_force_best(lm_weight, word_bonus):
    # Exhaustive reference: every frame labelling, collapsed, summed per word sequence, then the fused
    # score log P(x | seq) + lm_weight x log P_lm(seq </s>) + word_bonus x |seq| maximised.
    lm = BigramLM.estimate([["one", "two"], ["two", "two"], ["three", "one", "two"], ["one"]], VOCAB)
    lpm = np.array(lm.log_probs)
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        lp = torch.log_softmax(torch.randn(5, 4, generator=g), -1)
        acoustic: dict[tuple, float] = {}
        for path in itertools.product(range(4), repeat=5):
            onehot = torch.full((5, 4), -1e9)
            onehot[torch.arange(5), torch.tensor(path)] = 0.0
            seq = tuple(greedy_decode(onehot))
            score = sum(float(lp[t, k]) for t, k in enumerate(path))
            acoustic[seq] = np.logaddexp(acoustic.get(seq, -np.inf), score)

        def fused(seq, acoustic=acoustic):
            hist = (0, *seq, 0)
            lm_score = sum(lpm[h, w] for h, w in zip(hist[:-1], hist[1:]))
            return acoustic[seq] + lm_weight * lm_score + word_bonus * len(seq)

        best = max(acoustic, key=fused)
        got = beam_decode(lp, 500, prune=-math.inf, lm=lm, lm_weight=lm_weight, word_bonus=word_bonus)
        assert math.isclose(fused(tuple(got)), fused(best), rel_tol=1e-9), (got, best)


def test_decode_options_of_old_and_new_exports():
    lm = BigramLM.estimate([["one"]], VOCAB)
    new = {"vocab": VOCAB, "lm": lm.to_dict()}
    old = {"vocab": VOCAB}  # exported before the LM was stored
    cfg_old = {"beam": 8}  # ... and before lm_weight/word_bonus were config keys
    o = decode_options("RUN", cfg_old, new)
    assert (o.beam, o.lm_weight, o.word_bonus, o.note) == (8, 0.0, 0.0, "") and o.lm is not None
    o = decode_options("RUN", {"beam": 8, "lm_weight": 0.5, "word_bonus": 1.0}, new, lm_weight=0.2)
    assert (o.lm_weight, o.word_bonus) == (0.2, 1.0)  # a flag overrides the run's value, None keeps it
    o = decode_options("RUN", cfg_old, old, lm_weight=0.5, word_bonus=1.0)
    assert o.lm is None and o.lm_weight == 0.0 and o.word_bonus == 1.0
    assert "without a language model" in o.note and "--lm-weight 0.5 ignored" in o.note
    with pytest.raises(MarianaError, match="--beam >= 1"):
        decode_options("RUN", {"beam": 0}, new, lm_weight=0.5)
    with pytest.raises(MarianaError, match="--lm-weight must be >= 0"):
        decode_options("RUN", cfg_old, new, lm_weight=-1.0)
    o = decode_options("RUN", {"beam": 0}, old, lm_weight=0.5)  # ignored: greedy as before, with the note
    assert o.beam == 0 and o.lm_weight == 0.0 and o.note


@pytest.fixture(scope="module")
def tiny(data_dir, tmp_path_factory):
    """A prepared data dir (jackson's test set only is used) and an untrained debug model exported twice:
    with the bigram of its training text (as `train` exports now) and without (as before)."""
    import dataclasses

    from mariana.apps.asr.configs import PRESETS
    from mariana.apps.asr.model import build_model
    from mariana.apps.asr.train import BLANK
    from mariana.platform.core.export import export_model

    d = tmp_path_factory.mktemp("asr-lm")
    fsdd = d / "fsdd"
    fsdd.mkdir()
    for spk in ("george", "jackson"):
        for digit in range(10):
            name = f"{digit}_{spk}_0.wav"
            (fsdd / name).symlink_to(data_dir / "fsdd/recordings" / name)
    data = d / "data"
    cli(
        ["asr", "prepare", "--data", fsdd, "--out", data, "--test-speakers", "jackson"]
        + ["--utterances", "4", "--max-digits", "2"],
        check=True,
    )
    cfg = dataclasses.asdict(PRESETS["debug"]) | {"beam": 4}
    vocab = [BLANK] + sorted(
        {w for line in (data / "train/text").read_text().splitlines() for w in line.split()[1:]}
    )
    torch.manual_seed(0)
    state = build_model(cfg, len(vocab)).state_dict()
    runs = {}
    for name, extra in (
        ("new", {"vocab": vocab, "lm": BigramLM.from_text(data / "train/text", vocab).to_dict()}),
        ("old", {"vocab": vocab}),
    ):
        runs[name] = d / name
        export_model(runs[name], state, app="asr", arch="dnn-ctc", config=cfg, extra=extra)
    return data, runs


def test_eval_records_the_values_used_and_old_exports_decode_as_before(tiny):
    from mariana.apps.asr.evaluate import evaluate_run

    data, runs = tiny
    base = evaluate_run(str(runs["new"]), str(data / "test"))
    assert (base["beam"], base["lm_weight"], base["word_bonus"], base["note"]) == (4, 0.0, 0.0, "")
    fused = evaluate_run(str(runs["new"]), str(data / "test"), lm_weight=0.5, word_bonus=1.0)
    assert (fused["lm_weight"], fused["word_bonus"]) == (0.5, 1.0)
    saved = json.loads((runs["new"] / "eval" / "test.json").read_text())
    assert (saved["lm_weight"], saved["word_bonus"]) == (0.5, 1.0)
    old = evaluate_run(str(runs["old"]), str(data / "test"), lm_weight=0.5)
    assert old["lm_weight"] == 0.0 and "ignored" in old["note"]
    assert old["hypotheses"] == base["hypotheses"]  # the LM weight ignored: decoded exactly as before


def test_cli_flags(tiny, capfd):
    """The flags through the CLI, run in this process (`cliwalk.cli`)."""
    data, runs = tiny
    wav = sorted((data / "test" / "wav").glob("*.wav"))[0]
    t = cli(["asr", "transcribe", "--model", runs["old"], "--lm-weight", "1", wav], capfd, check=True)
    assert "note:" in t.stderr and "ignored" in t.stderr
    e = cli(["asr", "eval", "--model", runs["new"], "--data", data / "test", "--lm-weight", "-1"], capfd)
    assert_cli_error(e, "--lm-weight must be >= 0")
    e = cli(
        ["asr", "eval", "--model", runs["new"], "--data", data / "test", "--beam", "0", "--word-bonus", "1"],
        capfd,
    )
    assert_cli_error(e, "--beam >= 1")
