"""Cepstral mean/variance normalisation (CMVN): per speaker (training, `eval`) and per file with a
training-set prior (`transcribe`, the REST server, `eval --cmvn file`). `FilePrior`: the file's mean counted
together with ``frames`` pseudo-frames of the training speakers' average mean (a MAP estimate, as Kaldi's
online CMVN), and the training speakers' average within-speaker variance (README.md: why and measurements).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

# Pseudo-frames of prior mean in `FilePrior`: how many of a file's frames weigh as much as the training
# speakers' average mean. Chosen by measuring `transcribe` (= `eval --cmvn file`) on held-out and training
# speakers' files against each other setting and against per-speaker `eval` (apps/asr/README.md).
PRIOR_FRAMES = 30.0


def stats(f: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Sufficient statistics of features f [frames, dim] -> (sum [dim], sum of squares [dim], frames),
    accumulated in float64."""
    f64 = f.astype(np.float64)
    return f64.sum(0), (f64**2).sum(0), len(f)


def normalise(f: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """(f - mean) / std per bin, f [frames, dim] -> float32 [frames, dim] (mean/std rounded to float32
    first, so every path that normalises with the same statistics gives the same bits)."""
    return ((f - mean.astype(np.float32)) / std.astype(np.float32)).astype(np.float32)


def apply_cmvn(feats: list[np.ndarray], groups: list[str]) -> list[np.ndarray]:
    """Mean/variance normalisation per group (speaker or utterance): each bin to zero mean, unit variance
    over all frames of the group. feats: [frames_i, dim] arrays -> float32 arrays of the same shapes."""
    acc: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}
    for f, g in zip(feats, groups):
        s1, s2, n = stats(f)
        a1, a2, an = acc.get(g, (0.0, 0.0, 0))
        acc[g] = (a1 + s1, a2 + s2, an + n)
    norm = {}
    for g, (s1, s2, n) in acc.items():
        mean = s1 / n
        norm[g] = (mean, np.sqrt(np.maximum(s2 / n - mean**2, 1e-8)))
    return [normalise(f, *norm[g]) for f, g in zip(feats, groups)]


@dataclass(frozen=True)
class FilePrior:
    """Per-file CMVN with a prior: ``mean``/``var`` [dim] are the training speakers' average (frame-weighted
    mean of the speakers' means, and of their within-speaker variances); ``frames``: weight of the prior
    mean in pseudo-frames (0 = the file's own mean)."""

    mean: tuple[float, ...]
    var: tuple[float, ...]
    frames: float = PRIOR_FRAMES

    @classmethod
    def from_speaker_stats(cls, speakers: dict, frames: float = PRIOR_FRAMES) -> FilePrior:
        """``{speaker: {"sum": [dim], "sumsq": [dim], "frames": n}}`` (raw features, e.g. a training feature
        cache's ``speaker_stats``) -> the prior."""
        if not speakers:
            raise ValueError("no speaker statistics")
        total = sum(s["frames"] for s in speakers.values())
        mean = sum(np.asarray(s["sum"]) for s in speakers.values()) / total
        var = 0.0
        for s in speakers.values():
            m = np.asarray(s["sum"]) / s["frames"]
            var = var + (np.asarray(s["sumsq"]) - s["frames"] * m**2)  # within-speaker scatter
        var = np.maximum(var / total, 1e-8)
        return cls(tuple(float(x) for x in mean), tuple(float(x) for x in var), float(frames))

    def to_dict(self) -> dict:
        return {"mean": list(self.mean), "var": list(self.var), "frames": self.frames}

    @classmethod
    def from_dict(cls, d: dict) -> FilePrior:
        return cls(tuple(map(float, d["mean"])), tuple(map(float, d["var"])), float(d["frames"]))

    def digest(self) -> str:
        """Short hash of the statistics (part of a feature cache's key)."""
        return hashlib.sha1(json.dumps(self.to_dict()).encode()).hexdigest()[:12]

    def apply(self, f: np.ndarray) -> np.ndarray:
        """Normalise one file's raw features f [frames, dim] -> float32 [frames, dim]: mean adapted to
        the file (prior counted as ``frames`` frames), variance the prior's."""
        if f.shape[1] != len(self.mean):
            raise ValueError(f"features have {f.shape[1]} bins, the CMVN prior {len(self.mean)}")
        s1, _, n = stats(f)
        mean = (self.frames * np.asarray(self.mean) + s1) / (self.frames + n)
        return normalise(f, mean, np.sqrt(np.asarray(self.var)))
