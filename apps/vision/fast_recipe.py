"""The ``fast`` recipe (``--preset fast``), top to bottom: the airbench paper's methods (Keller Jordan, "94 %
on CIFAR-10 in 3.29 seconds on a single GPU", 2024), written from the paper, not from its code.

1. Hyperparameters (below; the ones that are flags live in the ``fast`` preset, `configs.PRESETS`).
2. The net, ``fastnet``: a frozen 2x2 patch-whitening convolution initialised from training images, three
   groups conv -> max-pool -> BN -> GELU -> conv -> BN -> GELU, a 3x3 max-pool, a bias-free linear head x 1/9.
3. Data: the whole decoded uint8 set on the training device; alternating flips (each image one random flip
   bit, all flipped every odd epoch) and a random translation per image and epoch, one gather per batch
   (`DeviceEpochLoader`).
4. Optimizer and schedule: three parameter groups (BN biases at 64x the lr, the whitening bias trained for
   3 epochs, the rest), a triangular lr, Lookahead to an EMA of the weights (`FastStep`).
5. Test-time augmentation: the mean of the softmax probabilities of 6 views (`tta_probabilities`); its
   ``flip`` mode serves every vision model (`vision eval/classify --tta`, REST).
6. The run: `init_whitening_from` (`mariana.apps.vision.train` hands the rest to the platform's `Trainer`).

Everything per step runs on the training device; the host reads nothing between log points (the random
numbers of an epoch are drawn on the device when it starts; schedules are Python floats).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.optim import fused_supported
from mariana.platform.core.steps import ModuleStep, unwrap
from torch import nn

from .data import DecodedImages, ImageSource, decode_all, normalize

# ---------------------------------------------------------------------------------------- 1. hyperparameters
WIDTHS = (64, 256, 256)  # channels of the three conv groups
WHITEN_KERNEL = 2  # the whitening layer's filters are WHITEN_KERNEL x WHITEN_KERNEL
WHITEN_EPS = 5e-4  # added to each patch-covariance eigenvalue before dividing by its square root
WHITEN_INIT_IMAGES = 5000  # training images whose patches initialise the whitening layer
BN_EPS, BN_MOMENTUM = 1e-12, 0.4  # PyTorch's momentum convention (the paper's 0.6 weighs the old value)
HEAD_SCALE = 1 / 9  # the logits' scale
TRANSLATE = 2  # random translation of up to this many pixels (reflect padding)
BIAS_LR_SCALE = 64.0  # BN biases: lr x this, weight decay / this (the same decay per step)
WHITEN_BIAS_EPOCHS = 3  # the whitening bias trains this many epochs, then its lr is 0
# triangular lr (x --lr): LR_START -> 1 over the first LR_PEAK_AT of the steps, then down to LR_END
LR_START, LR_PEAK_AT, LR_END = 0.2, 0.23, 0.07
LOOKAHEAD_EVERY = 5  # optimizer steps between Lookahead updates
LOOKAHEAD_BASE = 0.95**5  # the EMA's decay at the end of training (x (t/T)^3 before)
TTA_MODES = ("none", "flip", "crops")


# ----------------------------------------------------------------------------------------------- 2. the net
def _conv(cin: int, cout: int) -> nn.Conv2d:
    conv = nn.Conv2d(cin, cout, 3, padding="same", bias=False)
    with torch.no_grad():
        nn.init.dirac_(conv.weight[:cin])  # starts as identity on the first cin channels
    return conv


def _bn(c: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(c, eps=BN_EPS, momentum=BN_MOMENTUM)
    bn.weight.requires_grad_(False)  # no learned scale: only the bias (shift) trains
    return bn


class ConvGroup(nn.Sequential):
    """conv -> max-pool 2 -> BN -> GELU -> conv -> BN -> GELU: ``[B,cin,H,W]`` -> ``[B,cout,H/2,W/2]``."""

    def __init__(self, cin: int, cout: int):
        super().__init__(
            OrderedDict(
                conv1=_conv(cin, cout),
                pool=nn.MaxPool2d(2),
                norm1=_bn(cout),
                act1=nn.GELU(),
                conv2=_conv(cout, cout),
                norm2=_bn(cout),
                act2=nn.GELU(),
            )
        )


class Scale(nn.Module):
    """``x * factor`` (a head's logit scale; no parameters)."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def fastnet(num_classes: int = 10, widths: tuple[int, int, int] = WIDTHS) -> nn.Sequential:
    """The recipe's net: normalised float ``[B,3,32,32]`` -> logits ``[B, classes]``; an ``nn.Sequential`` like
    every other vision model. Call `init_whitening` with training images before training."""
    c0 = 2 * 3 * WHITEN_KERNEL**2
    whiten = nn.Conv2d(3, c0, WHITEN_KERNEL, padding=0, bias=True)
    whiten.weight.requires_grad_(False)  # frozen; only its bias trains (for WHITEN_BIAS_EPOCHS)
    nn.init.zeros_(whiten.bias)
    return nn.Sequential(
        OrderedDict(
            whiten=whiten,
            whiten_act=nn.GELU(),
            group1=ConvGroup(c0, widths[0]),
            group2=ConvGroup(widths[0], widths[1]),
            group3=ConvGroup(widths[1], widths[2]),
            pool=nn.MaxPool2d(3),
            flatten=nn.Flatten(),
            fc=nn.Linear(widths[2], num_classes, bias=False),
            scale=Scale(HEAD_SCALE),
        )
    )


def patches(x: torch.Tensor, k: int = WHITEN_KERNEL) -> torch.Tensor:
    """Every ``k x k`` patch (stride 1) of float images ``[N,C,H,W]`` -> ``[N*(H-k+1)*(W-k+1), C*k*k]``,
    flattened in the layout of a conv weight ``[C,k,k]``."""
    c = x.shape[1]
    return x.unfold(2, k, 1).unfold(3, k, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, c * k * k).float()


def whitening_weights(x: torch.Tensor, k: int = WHITEN_KERNEL, eps: float = WHITEN_EPS) -> torch.Tensor:
    """Conv weights ``[2*C*k*k, C, k, k]`` that whiten the ``k x k`` patches of normalised images ``x``
    ``[N,C,H,W]``: the eigenvectors ``v`` of the patches' uncentred covariance ``C``, largest eigenvalue
    first, each divided by ``sqrt(eigenvalue + eps)``, then the same filters negated (so the GELU after them
    keeps both signs). For a patch ``p`` the first half ``W p`` has covariance ``W C W^T = diag(lambda /
    (lambda + eps))``, the identity up to eps."""
    cov, n = 0, 0
    for i in range(0, len(x), 256):  # in chunks: 5000 CIFAR images have 4.8 M patches
        p = patches(x[i : i + 256], k).double()
        cov, n = cov + p.T @ p, n + len(p)
    cov = cov / n
    eigval, eigvec = torch.linalg.eigh(cov)  # ascending
    eigval, eigvec = eigval.flip(0), eigvec.flip(1)
    w = (eigvec / torch.sqrt(eigval + eps)).T.reshape(-1, x.shape[1], k, k)
    return torch.cat([w, -w]).float()


@torch.no_grad()
def init_whitening(net: nn.Sequential, images: torch.Tensor, eps: float = WHITEN_EPS) -> None:
    """Set ``net.whiten``'s weights from normalised training images ``[N,3,H,W]`` (any device)."""
    conv = net.whiten
    w = whitening_weights(images.to(conv.weight.device), conv.kernel_size[0], eps)
    conv.weight.copy_(w.to(conv.weight.dtype))


# ---------------------------------------------------------------------------------------------- 3. data
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

    def __init__(
        self, data: DecodedImages, batch_size: int, rank: int, world: int, seed: int, translate=TRANSLATE
    ):
        n = len(data)
        self.batches_per_epoch = n // (batch_size * world)
        if self.batches_per_epoch == 0:
            raise MarianaError(
                f"one epoch has 0 batches: {n} training images is less than one global batch "
                f"(--batch-size {batch_size} x {world} worker(s))"
            )
        self.data, self.bs, self.rank, self.world, self.seed = data, batch_size, rank, world, seed
        self.t = translate
        self.device = data.images.device
        self.padded = reflect_pad(data.images, translate)
        self.size = data.images.shape[-1]
        self.base_flip = torch.rand(n, generator=self._gen(-1), device=self.device) < 0.5

    def _gen(self, epoch: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + epoch + 1)

    def iterate(self, epoch: int, start: int = 0):
        n, g = len(self.data), self._gen(epoch)
        perm = torch.randperm(n, generator=g, device=self.device)
        shift = torch.randint(0, 2 * self.t + 1, (n, 2), generator=g, device=self.device)
        flip = self.base_flip ^ (epoch % 2 == 1)  # every odd epoch sees every image the other way
        gb = self.bs * self.world
        for b in range(start, self.batches_per_epoch):
            lo = b * gb + self.rank * self.bs
            idx = perm[lo : lo + self.bs]
            yield flip_translate(self.padded, idx, shift[idx], flip[idx], self.size), self.data.labels[idx]


# ------------------------------------------------------------------------------- 4. optimizer and schedule
def triangle(step: int, total: int, start=LR_START, peak=LR_PEAK_AT, end=LR_END) -> float:
    """Learning-rate multiplier at optimizer step ``step`` of ``total``: linear ``start -> 1`` over the first
    ``peak`` fraction of the steps, then linear ``1 -> end``."""
    top = int(peak * total)
    if step <= top:
        return start + (1 - start) * step / max(1, top)
    return 1 + (end - 1) * min(1.0, (step - top) / max(1, total - top))


def fast_optimizer(net: nn.Module, lr: float, momentum: float, weight_decay: float) -> torch.optim.SGD:
    """Nesterov SGD over ``net`` (a plain `fastnet`) in three groups, in this order: every other trainable
    weight, the whitening bias, the BN biases (at `BIAS_LR_SCALE` x ``lr``, weight decay / it)."""
    bn_bias = [p for n, p in net.named_parameters() if ".norm" in n and p.requires_grad]
    whiten_bias = [net.whiten.bias]
    taken = {id(p) for p in bn_bias + whiten_bias}
    rest = [p for p in net.parameters() if p.requires_grad and id(p) not in taken]
    groups = [
        {"params": rest, "lr": lr, "weight_decay": weight_decay},
        {"params": whiten_bias, "lr": lr, "weight_decay": weight_decay},
        {"params": bn_bias, "lr": lr * BIAS_LR_SCALE, "weight_decay": weight_decay / BIAS_LR_SCALE},
    ]
    kw = {"fused": True} if fused_supported(rest + bn_bias) else {}
    return torch.optim.SGD(groups, momentum=momentum, nesterov=True, **kw)


def fast_schedule(
    optimizer: torch.optim.Optimizer, total_steps: int, steps_per_epoch: int | None
) -> torch.optim.lr_scheduler.LambdaLR:
    """`triangle` for every group of `fast_optimizer`; the whitening bias's lr drops to 0 after
    `WHITEN_BIAS_EPOCHS` epochs of ``steps_per_epoch`` (None: a --max-steps run, it trains throughout)."""
    freeze_at = WHITEN_BIAS_EPOCHS * steps_per_epoch if steps_per_epoch else total_steps
    tri = lambda s: triangle(s, total_steps)  # noqa: E731
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, [tri, lambda s: tri(s) if s < freeze_at else 0.0, tri]
    )


class Lookahead:
    """An EMA copy of a model's floating-point state (parameters and BN statistics) that the weights are
    reset to every few steps (`update`)."""

    def __init__(self, model: nn.Module):
        live = [v for v in model.state_dict(keep_vars=True).values() if v.is_floating_point()]
        self.live = [v.data if isinstance(v, nn.Parameter) else v for v in live]
        self.ema = [v.detach().clone() for v in self.live]

    @torch.no_grad()
    def update(self, decay: float) -> None:
        torch._foreach_lerp_(self.ema, self.live, 1.0 - decay)
        torch._foreach_copy_(self.live, self.ema)


def lookahead_decay(step: int, total: int) -> float:
    return LOOKAHEAD_BASE * (step / total) ** 3


class FastStep(ModuleStep):
    """`ModuleStep` with `fast_optimizer`, `fast_schedule` and, after the optimizer step, Lookahead: every
    `LOOKAHEAD_EVERY` steps with `lookahead_decay`; at the last step the weights become the average.
    ``model`` may be wrapped (DDP, compile) around a `fastnet`."""

    def setup(self, total_steps: int) -> None:
        cfg, net = self.cfg, unwrap(self.model)
        self.total = total_steps
        self.optimizer = fast_optimizer(net, cfg.lr, cfg.momentum, cfg.weight_decay)
        per_epoch = max(1, total_steps // max(1, cfg.epochs)) if not cfg.max_steps else None
        self.scheduler = fast_schedule(self.optimizer, total_steps, per_epoch)
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


# ------------------------------------------------------------------------------ 5. test-time augmentation
def tta_views(x: torch.Tensor, mode: str) -> list[torch.Tensor]:
    """Normalised images ``[B,C,H,W]`` -> the views (each ``[B,C,H,W]``) that ``mode`` averages: ``none``
    the images; ``flip`` those and their mirror images; ``crops`` those plus the images translated by one
    pixel down-right and up-left (reflect padding), each also mirrored (6 views)."""
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


def tta_probabilities(model: nn.Module, x: torch.Tensor, mode: str = "none") -> torch.Tensor:
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


# -------------------------------------------------------------------------------------------- 6. the run
def init_whitening_from(
    net: nn.Sequential, data: DecodedImages | None, src: ImageSource, size: int, limit: int
):
    """``net``'s whitening layer from the first `WHITEN_INIT_IMAGES` training images: of the decoded set
    ``data``, or (streamed input, ``data`` None) that many of ``src``'s ``--limit`` subset decoded for it;
    the same images on every rank."""
    if data is not None:
        sample = data.images[:WHITEN_INIT_IMAGES]
    else:
        sample = decode_all(src, size, limit=min(limit or len(src), WHITEN_INIT_IMAGES)).images
    init_whitening(net, normalize(sample))
