"""``fastnet``: the network of the ``fast`` preset, written from the methods of Keller Jordan's airbench
paper ("94% on CIFAR-10 in 3.29 seconds on a single GPU", 2024): a frozen patch-whitening first layer
initialised from the training data, three conv groups (conv, max-pool, BN, GELU, conv, BN, GELU) of
widths 64-256-256, a final 3x3 max-pool and a bias-free linear head scaled by 1/9.

- Patch whitening: the first layer's 2x2 filters are the eigenvectors ``v_k`` of the (uncentred)
  covariance ``C`` of all 2x2x3 patches of training images, scaled by ``1/sqrt(lambda_k + eps)``, plus
  their negatives (so that the GELU after it keeps both signs): for a training patch ``p`` the first 12
  outputs ``W p`` have covariance ``W C W^T = diag(lambda_k / (lambda_k + eps))``, the identity up to eps.
  Its weights stay frozen; only its bias trains (for the first epochs, `recipe.FastStep`).
- BatchNorm without a learned scale (``weight`` frozen at 1), eps 1e-12, running-average momentum 0.4
  (PyTorch's convention; the paper's 0.6 is the weight of the old value).
- Convolutions start as identity (Dirac) maps on their first ``in_channels`` outputs.

The model is an ``nn.Sequential`` (its children run one after another) so the platform can treat it like
every other vision model. Input float ``[B,3,32,32]`` normalised images; output logits ``[B, classes]``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

WHITEN_KERNEL = 2
WHITEN_EPS = 5e-4


def _conv(cin: int, cout: int) -> nn.Conv2d:
    conv = nn.Conv2d(cin, cout, 3, padding="same", bias=False)
    with torch.no_grad():
        nn.init.dirac_(conv.weight[:cin])  # starts as identity on the first cin channels
    return conv


def _bn(c: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(c, eps=1e-12, momentum=0.4)
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
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def fastnet(num_classes: int = 10, widths: tuple[int, int, int] = (64, 256, 256)) -> nn.Sequential:
    """The ``fast`` preset's network (~1.97 M parameters at 10 classes) for 32 px input; call
    `init_whitening` with training images before training."""
    c0 = 2 * 3 * WHITEN_KERNEL**2
    whiten = nn.Conv2d(3, c0, WHITEN_KERNEL, padding=0, bias=True)
    whiten.weight.requires_grad_(False)
    nn.init.zeros_(whiten.bias)
    net = nn.Sequential(
        OrderedDict(
            whiten=whiten,
            whiten_act=nn.GELU(),
            group1=ConvGroup(c0, widths[0]),
            group2=ConvGroup(widths[0], widths[1]),
            group3=ConvGroup(widths[1], widths[2]),
            pool=nn.MaxPool2d(3),
            flatten=nn.Flatten(),
            fc=nn.Linear(widths[2], num_classes, bias=False),
            scale=Scale(1 / 9),
        )
    )
    return net


def patches(x: torch.Tensor, k: int = WHITEN_KERNEL) -> torch.Tensor:
    """Every ``k x k`` patch (stride 1) of float images ``[N,C,H,W]`` -> ``[N*(H-k+1)*(W-k+1), C*k*k]``,
    flattened in the layout of a conv weight ``[C,k,k]``."""
    c = x.shape[1]
    return x.unfold(2, k, 1).unfold(3, k, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, c * k * k).float()


def whitening_weights(x: torch.Tensor, k: int = WHITEN_KERNEL, eps: float = WHITEN_EPS) -> torch.Tensor:
    """Conv weights ``[2*C*k*k, C, k, k]`` that whiten the ``k x k`` patches of normalised images ``x``
    ``[N,C,H,W]``: eigenvectors of the patches' uncentred covariance, largest eigenvalue first, each divided
    by ``sqrt(eigenvalue + eps)``, then the same filters negated."""
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
