"""The acoustic models: filterbank frames -> per-frame log posteriors over word units + blank. `AcousticDNN`
(spliced frames, fully connected) or `AcousticTDNN` (dilated 1-D convolutions over frames); plain
single-device modules (data parallelism is applied from outside, train.py)."""

from __future__ import annotations

import torch
from mariana.platform.core.registry import create_model, register_model
from torch import nn


def splice(feats: torch.Tensor, context: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Stack each frame with its +-``context`` neighbours, on the device (spliced features are never stored).

    feats [B, T, F] (padded batch), lengths [B] valid frames per utterance (None: all T valid) ->
    [B, T, (2*context+1)*F], ordered frame t-context .. t+context. Neighbours outside an utterance repeat
    its first/last frame (as Kaldi's splice-feats does), by one gather with a cached index table."""
    if context == 0:
        return feats
    b, t, f = feats.shape
    w = 2 * context + 1
    win = _window_index(t, context, feats.device)  # [T, W]: clamp(t + j - context, 0, T - 1)
    if lengths is None:
        return feats[:, win].reshape(b, t, w * f)
    last = lengths.to(feats.device).view(b, 1, 1) - 1
    idx = torch.minimum(win, last).clamp_min_(0)  # [B, T, W]: never past the utterance's last frame
    return feats.gather(1, idx.view(b, t * w, 1).expand(b, t * w, f)).view(b, t, w * f)


_WINDOWS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _window_index(t: int, context: int, device: torch.device) -> torch.Tensor:
    """[T, 2*context+1] int64 on ``device``: clamp(t + j - context, 0, T - 1), kept per bucket length (64 at
    most); under ``torch.compile`` built in the graph (the compiler folds it; a cache would be a guard)."""
    if torch.compiler.is_compiling():
        return _build_window(t, context, device)
    key = (t, context, device)
    win = _WINDOWS.get(key)
    if win is None:
        if len(_WINDOWS) >= 64:  # unbucketed lengths (decoding, serving) must not grow it without bound
            _WINDOWS.clear()
        win = _WINDOWS[key] = _build_window(t, context, device)
    return win


def _build_window(t: int, context: int, device: torch.device) -> torch.Tensor:
    # Made on the device (no host-to-device copy, which would synchronise inside a step).
    ar = torch.arange(t, device=device).unsqueeze(1) + torch.arange(2 * context + 1, device=device)
    return (ar - context).clamp(0, t - 1)


def pad_edges(feats: torch.Tensor, context: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """feats [B, T, F] padded batch, lengths [B] (None: all T valid) -> [B, T + 2*context, F]: ``context``
    copies of each utterance's first frame before it, and its last valid frame repeated after it (over the
    batch padding too), so a window around any valid frame sees only its own utterance."""
    b, t, f = feats.shape
    if lengths is not None:
        # Replace padding with each utterance's last valid frame, so the right edge replicates per utterance.
        idx = torch.minimum(
            torch.arange(t, device=feats.device).unsqueeze(0), (lengths.to(feats.device) - 1).unsqueeze(1)
        )
        feats = feats.gather(1, idx.clamp_min(0).unsqueeze(-1).expand(b, t, f))
    return torch.cat([feats[:, :1].expand(b, context, f), feats, feats[:, -1:].expand(b, context, f)], dim=1)


class _Acoustic(nn.Module):
    """The constructor both acoustic models share (their `build_model` arguments): ``build`` makes the
    layers, with ``act`` the activation's module class."""

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
        act = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid}[activation]
        self.build(num_bins, context, hidden, layers, output_units, act, dropout, norm)


@register_model("asr", "dnn")
class AcousticDNN(_Acoustic):
    """Fully connected acoustic model.

    Input feats [B, T, num_bins] (float), lengths [B]; output log-probabilities [B, T, output_units]
    (float32). Unit 0 is the CTC blank, units 1..V-1 words; ``output_units`` may exceed the vocabulary
    (a "wide" output layer, as the classic senone DNNs had), the extra units are never targets."""

    def build(self, num_bins, context, hidden, layers, output_units, act, dropout, norm) -> None:
        self.context = context
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


def tdnn_dilations(context: int, layers: int) -> list[int]:
    """Dilations of the TDNN's kernel-3 layers (0 = a kernel-1 layer) whose receptive field is
    min(context, (3**layers - 1) / 2) frames each side. Each layer takes an equal share (rounded up) of the
    context still to cover, capped at 2 x (covered so far) + 1 so every offset stays reachable (1, 3, 9, ...
    tile without gaps; a first dilation of 2 would see even offsets only): small dilations first, as Kaldi."""
    out, covered = [], 0
    for i in range(layers):
        share = -(-(context - covered) // (layers - i))
        d = min(2 * covered + 1, share)
        out.append(d)
        covered += d
    return out


@register_model("asr", "tdnn")
class AcousticTDNN(_Acoustic):
    """Kaldi-style TDNN, in and out as `AcousticDNN`: ``layers`` x (Conv1d with the dilations of
    `tdnn_dilations`, [LayerNorm], activation, [Dropout]) -> Linear -> log-softmax. The input is edge-padded
    once per utterance (`pad_edges`) and every convolution is unpadded, so an utterance's outputs do not
    depend on its batch; LayerNorm rather than BatchNorm for the same reason."""

    def build(self, num_bins, context, hidden, layers, output_units, act, dropout, norm) -> None:
        self.dilations = tdnn_dilations(context, layers)
        self.receptive = sum(self.dilations)
        dims = [num_bins] + [hidden] * layers
        self.convs = nn.ModuleList(
            nn.Conv1d(dims[i], dims[i + 1], 3 if d else 1, dilation=max(d, 1))
            for i, d in enumerate(self.dilations)
        )
        self.norms = nn.ModuleList(
            nn.LayerNorm(hidden) if norm == "layer" else nn.Identity() for _ in self.convs
        )
        self.act = act()
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.out = nn.Linear(hidden, output_units)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        x = pad_edges(feats, self.receptive, lengths)  # [B, T + 2R, F]
        for conv, norm in zip(self.convs, self.norms):
            # Each unpadded convolution eats 2 x dilation frames: after all of them T frames remain.
            x = conv(x.transpose(1, 2)).transpose(1, 2)  # [B, T', hidden]
            x = self.drop(self.act(norm(x)))
        return torch.log_softmax(self.out(x).float(), dim=-1)


def build_model(cfg: dict, output_units: int) -> nn.Module:
    """The model described by a config dict (an `AsrConfig` as a dict, e.g. from model.json); exports
    without ``arch`` are DNNs."""
    mfcc = cfg.get("features", "fbank") == "mfcc"
    return create_model(
        "asr",
        cfg.get("arch", "dnn"),
        num_bins=cfg.get("num_ceps", 13) if mfcc else cfg["num_mel_bins"],
        output_units=max(output_units, cfg.get("output_units", 0)),
        **{k: cfg[k] for k in ("context", "hidden", "layers", "activation", "dropout", "norm")},
    )
