"""Test-time augmentation: class probabilities averaged over views of each image.

Modes: ``none`` (the image), ``flip`` (the image and its mirror image: 2 views) and ``crops`` (the flip
views plus the image translated by one pixel up-left and down-right with reflect padding, each also
mirrored: 6 views, the airbench paper's flip-and-translate views). The answer is the plain mean of the
views' softmax probabilities.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TTA_MODES = ("none", "flip", "crops")


def tta_views(x: torch.Tensor, mode: str) -> list[torch.Tensor]:
    """Normalised images ``[B,C,H,W]`` -> the list of views (each ``[B,C,H,W]``) that ``mode`` averages."""
    if mode not in TTA_MODES:
        raise ValueError(f"unknown TTA mode {mode!r}: choose one of {', '.join(TTA_MODES)}")
    if mode == "none":
        return [x]
    views = [x, x.flip(-1)]
    if mode == "crops":
        h, w = x.shape[-2:]
        xp = F.pad(x, (1, 1, 1, 1), mode="reflect")
        for dy, dx in ((0, 0), (2, 2)):  # content moved by +1 px / -1 px in both directions
            v = xp[..., dy : dy + h, dx : dx + w]
            views += [v, v.flip(-1)]
    return views


def tta_probabilities(model: torch.nn.Module, x: torch.Tensor, mode: str = "none") -> torch.Tensor:
    """Normalised images ``[B,C,H,W]`` -> float ``[B, classes]``: the mean over `tta_views` of
    ``softmax(model(view))``, computed in one forward pass over all views."""
    views = tta_views(x, mode)
    p = torch.softmax(model(torch.cat(views)).float(), dim=1)
    return p.view(len(views), len(x), -1).mean(0)


def tta_mode(value) -> str:
    """A TTA request (bool, or one of `TTA_MODES`, or 'true'/'false') -> a mode; True means ``flip``."""
    if isinstance(value, bool) or value is None:
        return "flip" if value else "none"
    v = str(value).lower()
    return {"true": "flip", "false": "none", "1": "flip", "0": "none"}.get(v, v)
