"""Inference API used by serving and ``mariana asr transcribe``: WAV bytes -> transcript.

A single request has no speaker statistics, so features are normalised per utterance."""

from __future__ import annotations

import dataclasses
import hashlib
import io
from pathlib import Path

import torch
from mariana.platform.core.export import WEIGHTS

from .decode import beam_decode, greedy_decode
from .evaluate import load_model
from .features import apply_cmvn, fbank, load_audio
from .train import feature_settings


class Transcriber:
    """``transcribe_wav_bytes(data) -> str`` (space-separated words); ``version`` names the weights."""

    def __init__(self, run_dir: str | Path, device: str = "cpu", beam: int | None = None):
        self.model, self.vocab, cfg = load_model(run_dir, device)
        self.device = device
        self.beam = cfg.get("beam", 0) if beam is None else beam
        s = feature_settings(cfg)
        self.settings = dataclasses.replace(s, cmvn="none" if s.cmvn == "none" else "utterance")
        digest = hashlib.sha256((Path(run_dir) / WEIGHTS).read_bytes()).hexdigest()[:12]
        self.version = f"asr-{digest}"

    @torch.no_grad()
    def transcribe_samples(self, samples: torch.Tensor) -> str:
        feats = fbank(samples, self.settings).numpy()
        if self.settings.cmvn != "none":
            feats = apply_cmvn([feats], ["utt"])[0]
        x = torch.from_numpy(feats).float().unsqueeze(0).to(self.device)
        logp = self.model(x)[0, :, : len(self.vocab)].float().cpu()
        units = beam_decode(logp, self.beam) if self.beam > 0 else greedy_decode(logp)
        return " ".join(self.vocab[k] for k in units)

    def transcribe_wav_bytes(self, data: bytes) -> str:
        """WAV file contents -> transcript. Raises MarianaError on undecodable audio."""
        return self.transcribe_samples(load_audio(io.BytesIO(data), self.settings))

    def transcribe_file(self, path: str | Path) -> str:
        return self.transcribe_samples(load_audio(str(path), self.settings))


def load_transcriber(run_dir: str | Path, device: str = "cpu") -> Transcriber:
    return Transcriber(run_dir, device)
