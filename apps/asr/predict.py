"""Inference API used by serving and ``mariana asr transcribe``: WAV bytes or file -> transcript.

Each file is normalised alone (`evaluate.file_settings`), exactly as ``mariana asr eval --cmvn file`` does,
so both give the same words for the same file."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from .decode import decode_options
from .evaluate import file_settings, load_model
from .features import apply_cmvn, fbank, feature_settings, load_audio


class Transcriber:
    """``transcribe_wav_bytes(data) -> str`` (space-separated words); ``version``: the exported weights'
    digest (`mariana.platform.core.export.weights_digest`). ``beam``, ``lm_weight``, ``word_bonus``:
    decoding options, None = the run's (`decode.decode_options`; ``self.decoding.note`` is a line for the
    user, e.g. an LM weight ignored)."""

    def __init__(
        self,
        run_dir: str | Path,
        device: str = "cpu",
        beam: int | None = None,
        lm_weight: float | None = None,
        word_bonus: float | None = None,
    ):
        self.model, self.vocab, cfg, meta = load_model(run_dir, device, with_meta=True)
        self.device = device
        self.decoding = decode_options(run_dir, cfg, meta, beam, lm_weight, word_bonus)
        self.beam = self.decoding.beam
        self.settings, self.prior = file_settings(feature_settings(cfg), meta)
        self.version: str = meta["version"]

    def features(self, samples: torch.Tensor) -> torch.Tensor:
        """Mono samples [N] -> normalised features [frames, dim], rounded through float16 as the feature
        cache stores them (so `eval --cmvn file` sees the same values)."""
        feats = fbank(samples, self.settings).numpy()
        if self.settings.cmvn == "file":
            feats = self.prior.apply(feats)
        elif self.settings.cmvn != "none":
            feats = apply_cmvn([feats], ["utt"])[0]
        return torch.from_numpy(feats.astype(np.float16).astype(np.float32))

    @torch.no_grad()
    def transcribe_samples(self, samples: torch.Tensor) -> str:
        x = self.features(samples).unsqueeze(0).to(self.device)
        logp = self.model(x)[0, :, : len(self.vocab)].float().cpu()
        units = self.decoding.decode(logp)
        return " ".join(self.vocab[k] for k in units)

    def onnx_graph(self, batch: int, gen: torch.Generator) -> tuple:
        """What `mariana export --format onnx` writes: (the acoustic model alone: normalised features float32
        ``[B, T, bins]`` -> log-probabilities ``[B, T, units]``, example features of ``batch`` noise signals
        drawn with ``gen`` (their length grows with ``batch``), the output's name, the dynamic axes).
        Features, CMVN and decoding stay here."""
        n = self.settings.sample_rate * (batch + 2) // 4
        feats = torch.stack([self.features(0.1 * torch.randn(n, generator=gen)) for _ in range(batch)])
        return self.model, {"feats": feats}, "log_probs", {"feats": {0: "batch", 1: "frames"}}

    def use_onnx(self, run) -> None:
        """Transcribe through ``run(feats) -> log-probabilities`` (the `onnx_graph` model in a runtime)."""
        self.model = run

    def transcribe_wav_bytes(self, data: bytes) -> str:
        """WAV file contents -> transcript. Raises MarianaError on undecodable or too short audio."""
        return self.transcribe_samples(load_audio(io.BytesIO(data), self.settings))

    def transcribe_file(self, path: str | Path) -> str:
        """WAV file -> transcript. Raises MarianaError naming the file on undecodable or too short audio."""
        return self.transcribe_samples(load_audio(str(path), self.settings))


def load_transcriber(run_dir: str | Path, device: str = "cpu") -> Transcriber:
    return Transcriber(run_dir, device)
