"""The acoustic DNN: spliced filterbank frames -> per-frame log posteriors over word units + blank.

A plain single-device `nn.Module`; data parallelism is applied from outside (train.py). Frame splicing
(+-``context`` frames, Kaldi style, edges replicated within each utterance) happens on the device with
`Tensor.unfold`, so spliced features are never stored.
"""

from __future__ import annotations

import torch
from torch import nn


def splice(feats: torch.Tensor, context: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Stack each frame with its +-``context`` neighbours.

    feats [B, T, F] (padded batch), lengths [B] valid frames per utterance (None: all T valid) ->
    [B, T, (2*context+1)*F], ordered frame t-context .. t+context. Neighbours outside an utterance repeat
    its first/last frame (as Kaldi's splice-feats does)."""
    if context == 0:
        return feats
    b, t, f = feats.shape
    if lengths is not None:
        # Replace padding with each utterance's last valid frame, so the right edge replicates per utterance.
        idx = torch.minimum(
            torch.arange(t, device=feats.device).unsqueeze(0), (lengths.to(feats.device) - 1).unsqueeze(1)
        )
        feats = feats.gather(1, idx.clamp_min(0).unsqueeze(-1).expand(b, t, f))
    padded = torch.cat(
        [feats[:, :1].expand(b, context, f), feats, feats[:, -1:].expand(b, context, f)], dim=1
    )
    win = padded.unfold(1, 2 * context + 1, 1)  # [B, T, F, W]
    return win.transpose(2, 3).reshape(b, t, (2 * context + 1) * f)


class AcousticDNN(nn.Module):
    """Fully connected acoustic model.

    Input feats [B, T, num_bins] (float), lengths [B]; output log-probabilities [B, T, output_units]
    (float32). Unit 0 is the CTC blank, units 1..V-1 words; ``output_units`` may exceed the vocabulary
    (a "wide" output layer, as the classic senone DNNs had), the extra units are never targets."""

    def __init__(
        self,
        num_bins: int = 40,
        context: int = 5,
        hidden: int = 512,
        layers: int = 4,
        output_units: int = 11,
        activation: str = "relu",
        dropout: float = 0.0,
        norm: str = "none",
    ):
        super().__init__()
        self.context = context
        act = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid}[activation]
        dims = [num_bins * (2 * context + 1)] + [hidden] * layers
        blocks: list[nn.Module] = []
        for i in range(layers):
            blocks.append(nn.Linear(dims[i], dims[i + 1]))
            if norm == "layer":
                blocks.append(nn.LayerNorm(dims[i + 1]))
            blocks.append(act())
            if dropout > 0:
                blocks.append(nn.Dropout(dropout))
        self.body = nn.Sequential(*blocks)
        self.out = nn.Linear(dims[-1], output_units)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        x = splice(feats, self.context, lengths)
        return torch.log_softmax(self.out(self.body(x)).float(), dim=-1)


def build_model(cfg: dict, output_units: int) -> AcousticDNN:
    """The model described by a config dict (an `AsrConfig` as a dict, e.g. from model.json)."""
    mfcc = cfg.get("features", "fbank") == "mfcc"
    return AcousticDNN(
        num_bins=cfg.get("num_ceps", 13) if mfcc else cfg["num_mel_bins"],
        context=cfg["context"],
        hidden=cfg["hidden"],
        layers=cfg["layers"],
        output_units=max(output_units, cfg.get("output_units", 0)),
        activation=cfg["activation"],
        dropout=cfg["dropout"],
        norm=cfg["norm"],
    )
