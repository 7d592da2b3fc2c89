"""CTC decoding (greedy and prefix beam search) of single utterances and of cached sets, and word/sentence
error rates."""

from __future__ import annotations

import math

import numpy as np
import torch

from .features import UtteranceSet, collate


def greedy_decode(logp: torch.Tensor, length: int | None = None, blank: int = 0) -> list[int]:
    """Best path: argmax per frame, merge repeats, drop blanks. logp [T, V] -> unit ids."""
    best = logp[: length if length is not None else logp.shape[0]].argmax(-1).tolist()
    out, prev = [], blank
    for k in best:
        if k != prev and k != blank:
            out.append(k)
        prev = k
    return out


def _lse(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    m = max(a, b)
    return m + math.log1p(math.exp(-abs(a - b)))


def beam_decode(
    logp: torch.Tensor, beam: int = 8, length: int | None = None, blank: int = 0, prune: float = -12.0
) -> list[int]:
    """CTC prefix beam search (Hannun et al. 2014) without a language model.

    logp [T, V] log-probabilities -> the most probable unit sequence summed over all its alignments.
    Units with log-probability below ``prune`` at a frame are not extended (the best unit always is)."""
    lp = logp[: length if length is not None else logp.shape[0]].double().cpu().numpy()
    beams: dict[tuple[int, ...], tuple[float, float]] = {
        (): (0.0, -math.inf)
    }  # prefix -> (p_blank, p_nonblank)
    for t in range(lp.shape[0]):
        row = lp[t]
        cand = np.nonzero(row >= prune)[0].tolist() or [int(row.argmax())]
        nxt: dict[tuple[int, ...], list[float]] = {}

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
                    add(prefix, -math.inf, pnb + p)  # repeat without a blank: same unit continues
                    add(prefix + (k,), -math.inf, pb + p)  # blank in between: a new unit
                else:
                    add(prefix + (k,), -math.inf, total + p)
        ranked = sorted(nxt.items(), key=lambda kv: _lse(*kv[1]), reverse=True)[:beam]
        beams = {k: (v[0], v[1]) for k, v in ranked}
    return list(max(beams.items(), key=lambda kv: _lse(*kv[1]))[0])


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    """Levenshtein distance between word lists (substitutions, insertions, deletions cost 1)."""
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def error_rates(refs: list[list[str]], hyps: list[list[str]]) -> dict[str, float]:
    """WER (%) = word edits / reference words; SER (%) = utterances with any error / utterances."""
    edits = sum(edit_distance(r, h) for r, h in zip(refs, hyps))
    words = sum(len(r) for r in refs)
    wrong = sum(r != h for r, h in zip(refs, hyps))
    return {
        "wer": 100.0 * edits / max(words, 1),
        "ser": 100.0 * wrong / max(len(refs), 1),
        "utterances": len(refs),
        "words": words,
    }


@torch.no_grad()
def utterance_logps(model, dataset: UtteranceSet, vocab: list[str], indices=None, batch: int = 64):
    """Yield ``(i, logp [frames_i, len(vocab)])`` for each utterance ``i`` of ``indices`` (default: all),
    run through ``model`` in length-sorted batches."""
    device = next(model.parameters()).device
    order = sorted(range(len(dataset)) if indices is None else indices, key=lambda i: dataset.lengths[i])
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        b = collate([dataset[i] for i in idx])
        logp = model(b["feats"].to(device), b["lengths"].to(device))[..., : len(vocab)].float().cpu()
        for j, i in enumerate(idx):
            yield i, logp[j, : int(b["lengths"][j])]


def decode_set(model, dataset: UtteranceSet, vocab: list[str], beam: int = 0, indices=None):
    """Decode the utterances ``indices`` (default: all) of ``dataset`` -> (refs, hyps) as word lists, in
    the order of ``indices``."""
    indices = list(range(len(dataset))) if indices is None else list(indices)
    hyps = {}
    for i, logp in utterance_logps(model, dataset, vocab, indices):
        units = beam_decode(logp, beam) if beam > 0 else greedy_decode(logp)
        hyps[i] = [vocab[k] for k in units]
    return [dataset.cache.utts[i]["words"] for i in indices], [hyps[i] for i in indices]
