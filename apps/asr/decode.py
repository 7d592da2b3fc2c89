"""CTC decoding (greedy and prefix beam search, optionally with a word bigram fused in) of single utterances
and of cached sets, and word/sentence error rates."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from mariana.platform.core.errors import MarianaError

from .configs import check_decode
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


class BigramLM:
    """Word bigram over the CTC units, with add-k smoothing: the "digit-loop grammar" (any sequence of
    vocabulary words, each weighted by how often it followed the previous one in the training text).

    ``words``: the model's units (index 0 = the blank); ``log_probs`` [V][V] natural-log probabilities,
    row = the previous unit, column = the next one. The blank's row stands for the sentence start <s> and
    its column for the sentence end </s> (the blank is never a word), so unit ids index the table."""

    def __init__(self, words: list[str], log_probs: list[list[float]], k: float = 1.0):
        if len(log_probs) != len(words) or any(len(r) != len(words) for r in log_probs):
            raise MarianaError(
                f"language model: log_probs must be {len(words)} x {len(words)} (one per unit)"
            )
        self.words, self.log_probs = list(words), [list(map(float, r)) for r in log_probs]
        self.k = float(k)  # the add-k smoothing it was estimated with (recorded, not used in decoding)

    @classmethod
    def estimate(cls, sentences: Iterable[list[str]], vocab: list[str], k: float = 1.0) -> BigramLM:
        """Maximum-likelihood bigram of ``sentences`` (word lists) with ``k`` added to every count:
        P(w | h) = (c(h, w) + k) / (c(h) + k x (words + 1)) over the vocabulary words and </s>.
        ``vocab[0]`` is the blank. A sentence with a word outside ``vocab`` is left out whole."""
        ids = {w: i for i, w in enumerate(vocab) if i > 0}
        counts = np.zeros((len(vocab), len(vocab)))
        for words in sentences:
            if any(w not in ids for w in words):
                continue
            seq = [0] + [ids[w] for w in words] + [0]  # 0 = <s> as a row, </s> as a column
            for h, w in zip(seq[:-1], seq[1:]):
                counts[h, w] += 1
        counts += k  # over every next unit: the words and </s> (the blank's column)
        logp = np.log(counts) - np.log(counts.sum(1, keepdims=True))
        return cls(vocab, logp.tolist(), k)

    @classmethod
    def from_text(cls, path: str | Path, vocab: list[str], k: float = 1.0) -> BigramLM:
        """`estimate` from a Kaldi ``text`` file (``utterance-id word word ...`` per line)."""
        lines = Path(path).read_text().splitlines()
        return cls.estimate((line.split()[1:] for line in lines if line.strip()), vocab, k)

    def to_dict(self) -> dict:
        """JSON-ready form, as stored in model.json under ``lm``."""
        return {"order": 2, "add_k": self.k, "words": self.words, "log_probs": self.log_probs}

    @classmethod
    def from_dict(cls, d: dict, vocab: list[str]) -> BigramLM:
        """From `to_dict`'s form; ``vocab`` (the model's units) must be the words it was estimated over."""
        if d.get("order") != 2:
            raise MarianaError(f"language model: only order 2 (bigram) is supported, got {d.get('order')!r}")
        if list(d.get("words", [])) != list(vocab):
            raise MarianaError("language model: its words are not the model's vocabulary")
        return cls(d["words"], d["log_probs"], d.get("add_k", 1.0))

    def fusion(self, lm_weight: float, word_bonus: float) -> tuple[list[list[float]], list[float]]:
        """(ext [V][V], end [V]): ext[h][w] = lm_weight x log P(w | h) + word_bonus, added when a prefix
        ending in unit h is extended by word w; end[h] = lm_weight x log P(</s> | h), added to a final
        prefix ending in h."""
        ext = [[lm_weight * x + word_bonus for x in row] for row in self.log_probs]
        return ext, [lm_weight * row[0] for row in self.log_probs]


def beam_decode(
    logp: torch.Tensor,
    beam: int = 8,
    length: int | None = None,
    blank: int = 0,
    prune: float = -12.0,
    lm: BigramLM | None = None,
    lm_weight: float = 0.0,
    word_bonus: float = 0.0,
) -> list[int]:
    """CTC prefix beam search (Hannun et al. 2014), with shallow fusion of a word bigram.

    logp [T, V] log-probabilities -> the most probable unit sequence summed over all its alignments.
    Units with log-probability below ``prune`` at a frame are not extended (the best unit always is).
    Extending a prefix by word k adds ``lm_weight x log P_lm(k | previous word) + word_bonus``, and the end
    ``lm_weight x log P_lm(</s> | last word)``; ``lm`` None (or ``lm_weight`` 0) scores acoustics only."""
    lp = logp[: length if length is not None else logp.shape[0]].double().cpu().numpy()
    v = lp.shape[1]
    zeros, ext, end = [0.0] * v, None, None  # ext[h][w], end[h]: see `BigramLM.fusion`
    if lm is not None and lm_weight != 0:
        ext, end = lm.fusion(lm_weight, word_bonus)
    elif word_bonus != 0:
        ext = [[word_bonus] * v] * v
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
            last = prefix[-1] if prefix else None
            # What extending this prefix by each word adds: its LM score and bonus, or exactly 0.0 (x + 0.0
            # is x, so the acoustic-only search is unchanged bit for bit).
            fuse = zeros if ext is None else ext[blank if last is None else last]
            for k in cand:
                p = float(row[k])
                if k == blank:
                    add(prefix, total + p, -math.inf)
                    continue
                if k == last:
                    add(prefix, -math.inf, pnb + p)  # repeat without a blank: same unit continues
                    add(prefix + (k,), -math.inf, pb + p + fuse[k])  # blank in between: a new unit
                else:
                    add(prefix + (k,), -math.inf, total + p + fuse[k])
        ranked = sorted(nxt.items(), key=lambda kv: _lse(*kv[1]), reverse=True)[:beam]
        beams = {k: (v[0], v[1]) for k, v in ranked}
    if end is None:
        return list(max(beams.items(), key=lambda kv: _lse(*kv[1]))[0])
    return list(max(beams.items(), key=lambda kv: _lse(*kv[1]) + end[kv[0][-1] if kv[0] else blank])[0])


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


def decode_set(
    model,
    dataset: UtteranceSet,
    vocab: list[str],
    beam: int = 0,
    indices=None,
    lm: BigramLM | None = None,
    lm_weight: float = 0.0,
    word_bonus: float = 0.0,
):
    """Decode the utterances ``indices`` (default: all) of ``dataset`` -> (refs, hyps) as word lists, in
    the order of ``indices``. ``lm``/``lm_weight``/``word_bonus``: shallow fusion in the beam search
    (`beam_decode`; ignored when greedy)."""
    indices = list(range(len(dataset))) if indices is None else list(indices)
    hyps = {}
    for i, logp in utterance_logps(model, dataset, vocab, indices):
        units = (
            beam_decode(logp, beam, lm=lm, lm_weight=lm_weight, word_bonus=word_bonus)
            if beam > 0
            else greedy_decode(logp)
        )
        hyps[i] = [vocab[k] for k in units]
    return [dataset.cache.utts[i]["words"] for i in indices], [hyps[i] for i in indices]


@dataclass
class DecodeOptions:
    """How an exported run decodes: ``beam`` (0 = greedy), the run's bigram ``lm`` (None in exports that
    have none), ``lm_weight``, ``word_bonus`` (the values used), ``note`` (a line to show the user, or "")."""

    beam: int
    lm: BigramLM | None
    lm_weight: float
    word_bonus: float
    note: str = ""

    def decode(self, logp: torch.Tensor) -> list[int]:
        """logp [T, V] -> unit ids, greedy or by beam search with these options."""
        if self.beam == 0:
            return greedy_decode(logp)
        return beam_decode(logp, self.beam, lm=self.lm, lm_weight=self.lm_weight, word_bonus=self.word_bonus)


def decode_options(
    run_dir: str | Path,
    cfg: dict,
    meta: dict,
    beam: int | None = None,
    lm_weight: float | None = None,
    word_bonus: float | None = None,
) -> DecodeOptions:
    """The decoding options of an exported run (config ``cfg`` and metadata ``meta`` of its model.json),
    each overridden where given (None = the run's). A run exported without a language model ignores
    ``lm_weight`` (with a note); raises MarianaError for a negative ``--beam``/``--lm-weight`` or LM
    options without a beam."""
    beam = cfg.get("beam", 0) if beam is None else beam
    lm_weight = cfg.get("lm_weight", 0.0) if lm_weight is None else lm_weight
    word_bonus = cfg.get("word_bonus", 0.0) if word_bonus is None else word_bonus
    check_decode(beam, lm_weight)
    lm, note = None, ""
    if "lm" in meta:
        try:
            lm = BigramLM.from_dict(meta["lm"], meta["vocab"])
        except MarianaError as e:
            raise MarianaError(f"{run_dir}: model.json: {e}") from None
    elif lm_weight:
        note = f"{run_dir}: exported without a language model; --lm-weight {lm_weight:g} ignored"
        lm_weight = 0.0
    if (lm_weight or word_bonus) and beam == 0:
        raise MarianaError("--lm-weight and --word-bonus act in the prefix beam search: set --beam >= 1")
    return DecodeOptions(beam, lm, float(lm_weight), float(word_bonus), note)
