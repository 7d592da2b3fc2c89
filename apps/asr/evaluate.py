"""``mariana asr eval``: WER/SER of an exported run on a Kaldi data dir: per-speaker CMVN as in training, or
(``--cmvn file``) each file normalised alone as `predict.Transcriber` does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.export import load_exported
from mariana.platform.core.rundir import write_eval_result

from .cmvn import FilePrior
from .configs import check_decode
from .decode import decode_options, decode_set, error_rates, utterance_logps
from .features import FeatureCache, FeatureSettings, UtteranceSet, cached_features, copy_tag, feature_settings
from .model import build_model


def load_model(run_dir: str | Path, device: str = "cpu", with_meta: bool = False):
    """(model in eval mode, vocab, config dict[, export metadata]) from an exported run."""
    state, meta = load_exported(run_dir, device, app="asr")
    cfg, vocab = meta["config"], meta["vocab"]
    model = build_model(cfg, len(vocab))
    model.load_state_dict(state)
    model = model.to(device).eval()
    return (model, vocab, cfg, meta) if with_meta else (model, vocab, cfg)


def file_settings(s: FeatureSettings, meta: dict) -> tuple[FeatureSettings, FilePrior | None]:
    """The feature settings for files normalised one at a time (``transcribe``, serving, ``eval --cmvn
    file``) -> (settings, prior). Per-speaker CMVN becomes per-file CMVN with the training speakers' prior
    stored in the export (``cmvn_prior``; per-utterance CMVN for exports without it); per-utterance and no
    CMVN need no speaker and stay as trained, and a model trained with ``--cmvn file`` uses its own prior."""
    if s.cmvn == "file":  # trained so: the prior it was trained with
        return s, FilePrior.from_dict(meta["cmvn_prior"])
    if s.cmvn != "speaker":
        return s, None
    if "cmvn_prior" in meta:
        return dataclasses.replace(s, cmvn="file"), FilePrior.from_dict(meta["cmvn_prior"])
    return dataclasses.replace(s, cmvn="utterance"), None


# --tempo auto tries these factors (frame shifts 8 .. 12 ms) for each speaker: the range of the `small`
# preset's speed perturbation, i.e. rates the model was trained on. (The confidence keeps rising past the
# fastest speaker's best factor, so the range is also what keeps the choice from running off.)
TEMPO_GRID = tuple(round(0.8 + 0.05 * k, 2) for k in range(9))


def peak_posteriors(logp: torch.Tensor) -> tuple[float, int]:
    """(sum, count) of the best unit's posterior over the frames of logp [T, V] whose best unit is a word
    rather than the blank: how sure the model is where it fires."""
    best = logp.max(-1)
    fired = best.indices != 0
    return float(best.values[fired].exp().sum()), int(fired.sum())


def choose_factor(
    model, vocab, caches: dict[float, FeatureCache], prefix=lambda f: "", speakers: set[str] | None = None
) -> dict[str, float]:
    """Each speaker's factor (tempo or VTLN warp): ``caches`` maps a factor to the data's features at that
    factor, whose ids and speakers carry ``prefix(factor)``; the result maps each original speaker name (only
    those in ``speakers``, default all) to the factor whose features give the highest mean peak posterior
    over the speaker's utterances, ties to the factor closest to 1 (no normalisation). No transcripts are
    used: Kaldi's per-speaker VTLN estimate by likelihood, with the model's confidence as likelihood."""
    stats: dict[str, dict[float, list[float]]] = {}
    for f, cache in caches.items():
        pre = prefix(f)
        spk = [u["spk"].removeprefix(pre) for u in cache.utts]
        idx = [i for i, k in enumerate(spk) if speakers is None or k in speakers]
        for i, logp in utterance_logps(model, UtteranceSet(cache, vocab), vocab, idx):
            total, n = peak_posteriors(logp)
            acc = stats.setdefault(spk[i], {}).setdefault(f, [0.0, 0])
            acc[0], acc[1] = acc[0] + total, acc[1] + n
    return {
        spk: max(per, key=lambda t: (per[t][0] / max(per[t][1], 1), -abs(t - 1.0)))
        for spk, per in stats.items()
    }


# --vtln auto tries these warps of the mel filters' frequency axis for each speaker (Kaldi VTLN: a warp
# > 1 treats the speaker's formants as if from a shorter vocal tract). The grid stays inside the range of
# `train --vtln-perturb` copies and of --vtln FACTOR.
VTLN_GRID = tuple(round(0.85 + 0.05 * k, 2) for k in range(7))
VTLN_RANGE = (0.7, 1.3)


def parse_vtln(vtln: float | str) -> float | str:
    """The ``--vtln`` value -> ``"auto"`` or a warp factor (float) in `VTLN_RANGE`; MarianaError naming
    ``--vtln`` otherwise. Cheap: called before the model or any feature is loaded."""
    if vtln == "auto":
        return "auto"
    try:
        w = float(vtln)
    except (TypeError, ValueError):
        raise MarianaError(f"--vtln must be a number or auto, got {vtln!r}") from None
    if not VTLN_RANGE[0] <= w <= VTLN_RANGE[1]:  # also refuses nan
        raise MarianaError(f"--vtln must be in [{VTLN_RANGE[0]:g}, {VTLN_RANGE[1]:g}] or auto, got {vtln}")
    return w


def warp_prefix(warp: float) -> str:
    """The prefix `features.extract` gives the ids and speakers of a copy warped by ``warp`` ("" at 1)."""
    return copy_tag(1.0, warp)


CMVN_MODES = ("speaker", "file")


def _check_options(beam: int | None, jobs: int, cmvn: str, tempo: float | str, vtln: float | str):
    """`MarianaError` for a bad --beam/--jobs/--cmvn/--tempo/--vtln -> (tempo: a float in [0.5, 2] or
    "auto", vtln: a warp or "auto")."""
    check_decode(beam, None)
    if jobs < 1:
        raise MarianaError(f"--jobs must be >= 1, got {jobs}")
    if cmvn not in CMVN_MODES:
        raise MarianaError(f"--cmvn must be one of {', '.join(CMVN_MODES)}, got {cmvn!r}")
    if tempo != "auto":
        try:
            tempo = float(tempo)
        except ValueError:
            raise MarianaError(f"--tempo must be a number or auto, got {tempo!r}") from None
        if not 0.5 <= tempo <= 2.0:
            raise MarianaError(f"--tempo must be in [0.5, 2], got {tempo}")
    vtln = parse_vtln(vtln)
    if vtln != 1.0 and cmvn == "file":
        raise MarianaError(
            "--vtln needs per-speaker CMVN: --cmvn file normalises each file alone, as `transcribe` does, "
            "and one file gives no speaker to estimate a warp for (use --cmvn speaker or --vtln 1)"
        )
    return tempo, vtln


class _Features:
    """The features of one Kaldi data dir at each (tempo, warp) asked for, computed once (cached under
    RUN/feats; at warp != 1 only the warped copies, ids and speakers prefixed `warp_prefix`)."""

    def __init__(self, d: Path, s: FeatureSettings, jobs: int, run_dir: str, prior: FilePrior | None):
        self.d, self.s, self.jobs, self.run_dir, self.prior = d, s, jobs, run_dir, prior
        self.caches: dict[tuple[float, float], FeatureCache] = {}

    def __call__(self, t: float, w: float) -> FeatureCache:
        if (t, w) not in self.caches:
            self.caches[t, w] = cached_features(
                self.d,
                dataclasses.replace(self.s, frame_shift_ms=self.s.frame_shift_ms * t),
                self.jobs,
                [(1.0, w, 1.0)],
                Path(self.run_dir) / "feats",
                prior=self.prior,
            )
        return self.caches[t, w]


def _speaker_settings(model, vocab, features: _Features, base: FeatureCache, tempo, vtln):
    """-> ({speaker: tempo}, {speaker: warp}): the given values, or with "auto" each speaker's most
    confident one (tempo first at warp 1, then the warp at that speaker's tempo)."""
    if tempo == "auto":
        # a speaker slower or faster than the training speakers is heard most confidently once normalised
        # to their pace, as a VTLN warp is chosen by likelihood
        chosen = choose_factor(model, vocab, {t: features(t, 1.0) for t in TEMPO_GRID})
    else:
        chosen = {u["spk"]: tempo for u in base.utts}
    if vtln == "auto":
        warps: dict[str, float] = {}
        for t in sorted(set(chosen.values())):  # each speaker's warp at the tempo chosen for it
            spks = {k for k, v in chosen.items() if v == t}
            warps.update(
                choose_factor(model, vocab, {w: features(t, w) for w in VTLN_GRID}, warp_prefix, spks)
            )
    else:
        warps = {k: vtln for k in chosen}
    return chosen, warps


def _decode_groups(model, vocab, opts, features: _Features, chosen: dict, warps: dict):
    """Decode each speaker's utterances at its (tempo, warp) -> (references, hypotheses, utterance ids
    without the warp prefix), grouped by (tempo, warp)."""
    refs, hyps, utt_ids = [], [], []
    for t, w in sorted({(chosen[k], warps[k]) for k in chosen if k in warps}):
        cache, pre = features(t, w), warp_prefix(w)
        idx = [
            i
            for i, u in enumerate(cache.utts)
            if (chosen.get(u["spk"].removeprefix(pre)), warps.get(u["spk"].removeprefix(pre))) == (t, w)
        ]
        r_, h_ = decode_set(
            model, UtteranceSet(cache, vocab), vocab, opts.beam, idx, opts.lm, opts.lm_weight, opts.word_bonus
        )
        ids = [cache.utts[i]["utt"].removeprefix(pre) for i in idx]
        refs, hyps, utt_ids = refs + r_, hyps + h_, utt_ids + ids
    return refs, hyps, utt_ids


def evaluate_run(
    run_dir: str,
    data: str,
    beam: int | None = None,
    jobs: int = 2,
    tempo: float | str = 1.0,
    cmvn: str = "speaker",
    lm_weight: float | None = None,
    word_bonus: float | None = None,
    vtln: float | str = 1.0,
) -> dict:
    """Decode ``data`` (a Kaldi data dir) with the model in ``run_dir`` -> the result (WER, SER, each
    utterance's hypothesis under its original id, the options used, ``note`` a line for the user), also
    written to ``RUN/eval/<data name>.json``. The flags' meaning: ``mariana asr eval --help``.

    ``tempo`` scales the frame shift (window unchanged); ``vtln`` warps the mel filters (`features.fbank`);
    ``"auto"`` picks each speaker's most confident value (`choose_factor`), tempo first at warp 1, then the
    warp at that tempo (9 + 7 feature passes instead of the 63 of the product grid). VTLN needs speaker
    statistics: refused where files are normalised one at a time (``cmvn="file"`` or a model trained so)."""
    tempo, vtln = _check_options(beam, jobs, cmvn, tempo, vtln)
    model, vocab, cfg, meta = load_model(run_dir, with_meta=True)
    opts = decode_options(run_dir, cfg, meta, beam, lm_weight, word_bonus)
    d = Path(data)
    if not (d / "wav.scp").is_file():
        raise MarianaError(f"--data {data}: no wav.scp (expected a Kaldi data dir such as OUT/test)")
    s, prior = feature_settings(cfg), None
    if cmvn == "file" or s.cmvn == "file":  # a model trained per file is always evaluated per file
        s, prior = file_settings(s, meta)
    if vtln != 1.0 and s.cmvn == "file":
        raise MarianaError(
            f"--vtln: {run_dir} was trained with --cmvn file and is always evaluated one file at a time; "
            "one file gives no speaker to estimate a warp for (use --vtln 1)"
        )
    features = _Features(d, s, jobs, run_dir, prior)
    # The unwarped features: the readable utterances and the skipped recordings (`extract` lists skipped
    # audio for unperturbed copies only).
    base = features(1.0 if tempo == "auto" else tempo, 1.0)
    if len(base) == 0:
        raise MarianaError(f"--data {data}: no readable utterances")
    with torch.no_grad():
        chosen, warps = _speaker_settings(model, vocab, features, base, tempo, vtln)
        refs, hyps, utt_ids = _decode_groups(model, vocab, opts, features, chosen, warps)
    result = {
        **error_rates(refs, hyps),  # wer, ser, utterances, words
        "beam": opts.beam,
        "lm_weight": opts.lm_weight,
        "word_bonus": opts.word_bonus,
        "tempo": tempo,
        "cmvn": s.cmvn,
        "speaker_tempo": chosen,
        "vtln": vtln,
        "speaker_vtln": warps,
        "data": str(d),
        "skipped": len(base.skipped),
        "skipped_paths": [x["path"] for x in base.skipped],
        "hypotheses": {u: " ".join(h) for u, h in sorted(zip(utt_ids, hyps))},
    }
    result["path"] = str(write_eval_result(result, run_dir, data))
    result["note"] = opts.note
    return result
