"""The ``fast`` training recipe (``--recipe fast``), from the airbench paper's methods (Jordan 2024):

- Nesterov SGD with three parameter groups: BatchNorm biases at ``BIAS_LR_SCALE`` x the learning rate and
  weight decay / ``BIAS_LR_SCALE`` (the same decay per step), the whitening layer's bias (trained for the
  first ``WHITEN_BIAS_EPOCHS`` epochs, then frozen by a zero learning rate), and every other weight;
- a triangular learning-rate schedule: ``0.2 -> 1`` (x ``--lr``) at 23 % of the steps, then down to 0.07;
- Lookahead to an exponential moving average: every ``LOOKAHEAD_EVERY`` steps the average moves toward the
  weights with decay ``0.95^5 * (t / T)^3`` and the weights jump to it; at the last step the weights become
  the average (`Lookahead`);
- derandomised alternating flips: each image gets one random flip bit, and every odd epoch flips all of
  them, so each image is seen both ways in every two epochs; plus a random translation of up to
  ``TRANSLATE`` px (reflect padding) per image and epoch (`DeviceEpochLoader`).

Everything per step runs on the training device; the host reads nothing between log points (the random
numbers of an epoch are drawn on the device when it starts; schedules are Python floats).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.optim import fused_supported
from mariana.platform.core.steps import ModuleStep, unwrap

BIAS_LR_SCALE = 64.0
WHITEN_BIAS_EPOCHS = 3
LOOKAHEAD_EVERY = 5
TRANSLATE = 2


def triangle(step: int, total: int, start: float = 0.2, peak: float = 0.23, end: float = 0.07) -> float:
    """Learning-rate multiplier at optimizer step ``step`` of ``total``: linear ``start -> 1`` over the first
    ``peak`` fraction of the steps, then linear ``1 -> end``."""
    top = int(peak * total)
    if step <= top:
        return start + (1 - start) * step / max(1, top)
    return 1 + (end - 1) * min(1.0, (step - top) / max(1, total - top))


class Lookahead:
    """An EMA copy of a model's floating-point state (parameters and BN statistics) that the weights are
    reset to every few steps (`update`)."""

    def __init__(self, model: torch.nn.Module):
        live = [v for v in model.state_dict(keep_vars=True).values() if v.is_floating_point()]
        self.live = [v.data if isinstance(v, torch.nn.Parameter) else v for v in live]
        self.ema = [v.detach().clone() for v in self.live]

    @torch.no_grad()
    def update(self, decay: float) -> None:
        torch._foreach_lerp_(self.ema, self.live, 1.0 - decay)
        torch._foreach_copy_(self.live, self.ema)


def lookahead_decay(step: int, total: int) -> float:
    return 0.95**5 * (step / total) ** 3


class FastStep(ModuleStep):
    """`ModuleStep` with the fast recipe's optimizer groups, schedule and Lookahead. ``model`` may be
    wrapped (DDP, compile); its plain module must be a `fastnet`."""

    def setup(self, total_steps: int) -> None:
        cfg, net = self.cfg, unwrap(self.model)
        self.total = total_steps
        bn_bias = [p for n, p in net.named_parameters() if ".norm" in n and p.requires_grad]
        whiten_bias = [net.whiten.bias]
        taken = {id(p) for p in bn_bias + whiten_bias}
        rest = [p for p in net.parameters() if p.requires_grad and id(p) not in taken]
        groups = [
            {"params": rest, "lr": cfg.lr, "weight_decay": cfg.weight_decay},
            {"params": whiten_bias, "lr": cfg.lr, "weight_decay": cfg.weight_decay},
            {
                "params": bn_bias,
                "lr": cfg.lr * BIAS_LR_SCALE,
                "weight_decay": cfg.weight_decay / BIAS_LR_SCALE,
            },
        ]
        kw = {"fused": True} if fused_supported(rest + bn_bias) else {}
        self.optimizer = torch.optim.SGD(groups, momentum=cfg.momentum, nesterov=True, **kw)
        per_epoch = max(1, total_steps // max(1, cfg.epochs)) if not cfg.max_steps else None
        freeze_at = WHITEN_BIAS_EPOCHS * per_epoch if per_epoch else total_steps
        tri = lambda s: triangle(s, total_steps)  # noqa: E731
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, [tri, lambda s: tri(s) if s < freeze_at else 0.0, tri]
        )
        self.lookahead = Lookahead(net)

    def train_step(self, micro_batches: list[Any]) -> tuple[torch.Tensor, int]:
        out = super().train_step(micro_batches)
        t = self.scheduler.last_epoch  # optimizer steps done
        if t >= self.total:
            self.lookahead.update(1.0)  # the weights become the average
        elif t % LOOKAHEAD_EVERY == 0:
            self.lookahead.update(lookahead_decay(t, self.total))
        return out

    def checkpoint_state(self, folder: Path) -> dict[str, Any]:
        return {**super().checkpoint_state(folder), "lookahead": self.lookahead.ema}

    def restore(self, state: dict[str, Any], folder: Path) -> None:
        super().restore(state, folder)
        for dst, src in zip(self.lookahead.ema, state["lookahead"]):
            dst.copy_(src)


# ------------------------------------------------------------------------------------------------ data
def reflect_pad(images: torch.Tensor, pad: int, chunk: int = 8192) -> torch.Tensor:
    """uint8 ``[N,3,S,S]`` -> uint8 ``[N,3,S+2p,S+2p]`` with reflect padding (once per data set)."""
    out = [
        F.pad(images[i : i + chunk].float(), (pad,) * 4, mode="reflect") for i in range(0, len(images), chunk)
    ]
    return torch.cat(out).to(torch.uint8)


def flip_translate(
    padded: torch.Tensor, idx: torch.Tensor, shift: torch.Tensor, flip: torch.Tensor, size: int
) -> torch.Tensor:
    """One gather: images ``padded[idx]`` (uint8 ``[N,3,S+2p,S+2p]``) cropped at offsets ``shift [B,2]``
    (row, column in ``0..2p``) of their mirror image where ``flip [B]`` is true -> uint8 ``[B,3,S,S]``."""
    ar = torch.arange(size, device=padded.device)
    width = padded.shape[-1]
    rows = shift[:, :1] + ar  # [B,S]
    cols = torch.where(flip[:, None], width - 1 - shift[:, 1:] - ar, shift[:, 1:] + ar)
    ch = torch.arange(padded.shape[1], device=padded.device)
    return padded[
        idx[:, None, None, None], ch[None, :, None, None], rows[:, None, :, None], cols[:, None, None, :]
    ]


class DeviceEpochLoader:
    """`BatchLoader` over a decoded set on the training device with the recipe's augmentation:
    (uint8 ``[B,3,S,S]``, int64 ``[B]``). Global batch ``b`` of an epoch is positions ``b*B*W .. +B*W`` of
    that epoch's permutation; rank ``r`` takes its ``B`` of them. The permutation, shifts and flip bits
    depend only on (seed, epoch), so a resumed run sees the same batches."""

    def __init__(self, data, batch_size: int, rank: int, world: int, seed: int, translate: int = TRANSLATE):
        n = len(data)
        self.batches_per_epoch = n // (batch_size * world)
        if self.batches_per_epoch == 0:
            raise MarianaError(
                f"one epoch has 0 batches: {n} training images is less than one global batch "
                f"(--batch-size {batch_size} x {world} worker(s))"
            )
        self.data, self.bs, self.rank, self.world, self.seed, self.t = (
            data,
            batch_size,
            rank,
            world,
            seed,
            translate,
        )
        self.device = data.images.device
        self.padded = reflect_pad(data.images, translate)
        self.size = data.images.shape[-1]
        g = self._gen(-1)
        self.base_flip = torch.rand(n, generator=g, device=self.device) < 0.5

    def _gen(self, epoch: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + epoch + 1)

    def iterate(self, epoch: int, start: int = 0):
        n, g = len(self.data), self._gen(epoch)
        perm = torch.randperm(n, generator=g, device=self.device)
        shift = torch.randint(0, 2 * self.t + 1, (n, 2), generator=g, device=self.device)
        flip = self.base_flip ^ (epoch % 2 == 1)
        gb = self.bs * self.world
        for b in range(start, self.batches_per_epoch):
            lo = b * gb + self.rank * self.bs
            idx = perm[lo : lo + self.bs]
            yield flip_translate(self.padded, idx, shift[idx], flip[idx], self.size), self.data.labels[idx]
