"""``mariana asr eval``: WER/SER of an exported run on a Kaldi data dir (per-speaker CMVN, as in training)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.export import load_exported

from .decode import error_rates
from .features import FeatureCache, cached_features
from .model import build_model
from .train import UtteranceSet, decode_set, feature_settings


def load_model(run_dir: str | Path, device: str = "cpu"):
    """(model in eval mode, vocab, config dict) from an exported run."""
    state, meta = load_exported(run_dir, device)
    if meta.get("job") != "asr":
        raise MarianaError(f"{run_dir}: not an ASR model (job {meta.get('job')!r})")
    cfg, vocab = meta["config"], meta["vocab"]
    model = build_model(cfg, len(vocab))
    model.load_state_dict(state)
    return model.to(device).eval(), vocab, cfg


def evaluate_run(run_dir: str, data: str, beam: int | None = None, jobs: int = 2) -> dict:
    """Decode ``data`` (a Kaldi data dir) with the model in ``run_dir``; writes ``RUN/eval.json``."""
    model, vocab, cfg = load_model(run_dir)
    d = Path(data)
    if not (d / "wav.scp").is_file():
        raise MarianaError(f"--data {data}: no wav.scp (expected a Kaldi data dir such as OUT/test)")
    cache: FeatureCache = cached_features(d, feature_settings(cfg), jobs, (1.0,), Path(run_dir) / "feats")
    if len(cache) == 0:
        raise MarianaError(f"--data {data}: no readable utterances")
    beam = cfg.get("beam", 0) if beam is None else beam
    with torch.no_grad():
        refs, hyps = decode_set(model, UtteranceSet(cache, vocab), vocab, beam)
    r = error_rates(refs, hyps)
    result = {
        "wer": r["wer"],
        "ser": r["ser"],
        "utterances": r["utterances"],
        "words": r["words"],
        "beam": beam,
        "data": str(d),
        "skipped": len(cache.skipped),
        "skipped_paths": [x["path"] for x in cache.skipped],
    }
    (Path(run_dir) / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
