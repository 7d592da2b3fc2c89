"""``mariana asr eval``: WER/SER of an exported run on a Kaldi data dir: per-speaker CMVN as in training, or
(``--cmvn file``) each file normalised alone as `predict.Transcriber` does."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from mariana.platform.core.atomic import atomic_write_text
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.export import load_exported
from mariana.platform.core.rundir import eval_result_path

from .cmvn import FilePrior
from .decode import decode_set, error_rates, utterance_logps
from .features import FeatureCache, FeatureSettings, UtteranceSet, cached_features, feature_settings
from .model import build_model


def load_model(run_dir: str | Path, device: str = "cpu", with_meta: bool = False):
    """(model in eval mode, vocab, config dict[, export metadata]) from an exported run."""
    state, meta = load_exported(run_dir, device)
    if meta.get("app") != "asr":
        raise MarianaError(f"{run_dir}: not an ASR model (app {meta.get('app')!r})")
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


def choose_tempo(model, vocab, caches: dict[float, FeatureCache]) -> dict[str, float]:
    """Each speaker's tempo: the factor whose features give the highest mean peak posterior over the
    speaker's utterances (no transcripts used). A speaker slower or faster than the training speakers is
    heard most confidently once normalised to their pace, as a VTLN warp is chosen by likelihood."""
    stats: dict[str, dict[float, list[float]]] = {}
    for t, cache in caches.items():
        for i, logp in utterance_logps(model, UtteranceSet(cache, vocab), vocab):
            total, n = peak_posteriors(logp)
            acc = stats.setdefault(cache.utts[i]["spk"], {}).setdefault(t, [0.0, 0])
            acc[0], acc[1] = acc[0] + total, acc[1] + n
    return {
        spk: max(per, key=lambda t: (per[t][0] / max(per[t][1], 1), -abs(t - 1.0)))
        for spk, per in stats.items()
    }


CMVN_MODES = ("speaker", "file")


def evaluate_run(
    run_dir: str,
    data: str,
    beam: int | None = None,
    jobs: int = 2,
    tempo: float | str = 1.0,
    cmvn: str = "speaker",
) -> dict:
    """Decode ``data`` (a Kaldi data dir) with the model in ``run_dir``; writes the result (WER, SER, each
    utterance's hypothesis) to ``eval_result_path(run_dir, data)`` = ``RUN/eval/<data name>.json``.

    ``tempo`` scales the frame shift (10 ms x tempo, window unchanged): test-time speaking-rate
    normalisation for a speaker ``tempo`` times slower than the training speakers; ``"auto"`` picks it per
    speaker from `TEMPO_GRID` with `choose_tempo`. ``cmvn``: ``"speaker"`` normalises with each speaker's
    statistics over ``data`` (as in training); ``"file"`` normalises each file alone exactly as
    ``transcribe`` and the server do (`file_settings`), so their transcripts are this mode's hypotheses."""
    if beam is not None and beam < 0:
        raise MarianaError(f"--beam must be >= 0 (0 = greedy), got {beam}")
    if jobs < 1:
        raise MarianaError(f"--jobs must be >= 1, got {jobs}")
    if cmvn not in CMVN_MODES:
        raise MarianaError(f"--cmvn must be one of {', '.join(CMVN_MODES)}, got {cmvn!r}")
    auto = tempo == "auto"
    if not auto:
        try:
            tempo = float(tempo)
        except ValueError:
            raise MarianaError(f"--tempo must be a number or auto, got {tempo!r}") from None
        if not 0.5 <= tempo <= 2.0:
            raise MarianaError(f"--tempo must be in [0.5, 2], got {tempo}")
    model, vocab, cfg, meta = load_model(run_dir, with_meta=True)
    d = Path(data)
    if not (d / "wav.scp").is_file():
        raise MarianaError(f"--data {data}: no wav.scp (expected a Kaldi data dir such as OUT/test)")
    s, prior = feature_settings(cfg), None
    if cmvn == "file" or s.cmvn == "file":  # a model trained per file is always evaluated per file
        s, prior = file_settings(s, meta)
    caches: dict[float, FeatureCache] = {
        t: cached_features(
            d,
            dataclasses.replace(s, frame_shift_ms=s.frame_shift_ms * t),
            jobs,
            (1.0,),
            Path(run_dir) / "feats",
            prior=prior,
        )
        for t in (TEMPO_GRID if auto else (tempo,))
    }
    base = caches[1.0 if auto else tempo]
    if len(base) == 0:
        raise MarianaError(f"--data {data}: no readable utterances")
    beam = cfg.get("beam", 0) if beam is None else beam
    with torch.no_grad():
        chosen = choose_tempo(model, vocab, caches) if auto else {u["spk"]: tempo for u in base.utts}
        refs, hyps, utt_ids = [], [], []
        for t in sorted(set(chosen.values())):
            cache = caches[t]
            idx = [i for i, u in enumerate(cache.utts) if chosen.get(u["spk"]) == t]
            r_, h_ = decode_set(model, UtteranceSet(cache, vocab), vocab, beam, idx)
            refs, hyps, utt_ids = refs + r_, hyps + h_, utt_ids + [cache.utts[i]["utt"] for i in idx]
    r = error_rates(refs, hyps)
    result = {
        "wer": r["wer"],
        "ser": r["ser"],
        "utterances": r["utterances"],
        "words": r["words"],
        "beam": beam,
        "tempo": tempo,
        "cmvn": s.cmvn,
        "speaker_tempo": chosen,
        "data": str(d),
        "skipped": len(base.skipped),
        "skipped_paths": [x["path"] for x in base.skipped],
        "hypotheses": {u: " ".join(h) for u, h in sorted(zip(utt_ids, hyps))},
    }
    path = eval_result_path(run_dir, data)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")
    result["path"] = str(path)
    return result
