"""Vision models by name (`build_model`): those registered below (``cifar-fast``: the ResNet-9 layout at
width 16, the CPU presets' net, not the ``fast`` recipe's; ``resnet9``: width 64, ``gpu94``'s; ``fastnet``:
in `fast_recipe`; ``mariana-cnn`` / ``mariana-cnn-32``) and any torchvision model, each a plain
single-device ``nn.Module``. `as_blocks` gives the pipeline framework the model as an ``nn.Sequential`` of
blocks (torchvision ResNet/AlexNet/VGG converted, sharing their parameters).

``mariana-cnn``: AlexNet as published splits every layer's kernels between two GPUs ("columns"); a
convolution with ``groups=2`` is exactly two such private columns, so it is one single-device model with
the paper's connectivity and parameter count; the framework places stages (depth), not columns, on devices.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.registry import create_model, list_models, register_model
from torch import nn

from .fast_recipe import Scale, fastnet


def conv_bn(cin: int, cout: int, pool: bool = False) -> nn.Sequential:
    layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
    if pool:
        layers.insert(1, nn.MaxPool2d(2))  # pool before BN: 4x fewer positions to normalise
    return nn.Sequential(*layers)


class GlobalMaxPool(nn.Module):
    """``[B, C, H, W]`` -> ``[B, C, 1, 1]``, the maximum over H and W: ``AdaptiveMaxPool2d(1)``'s values and
    gradient (all to the first maximum; ``amax`` would split it between ties, common after a ReLU), as ``max``
    over the flattened map because torch's ONNX exporter has no translation of adaptive_max_pool2d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).max(2).values[..., None, None]


class Residual(nn.Module):
    """``x + f(x)``."""

    def __init__(self, f: nn.Module):
        super().__init__()
        self.f = f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


def resnet9_layout(num_classes: int = 10, width: int = 32) -> nn.Sequential:
    """The DAWNBench ResNet-9 layout at ``width`` for 32 px images: prep conv, three pooling stages (two
    with a residual pair), global max-pool, linear, logits x 1/8 (so the max-pooled features start with a
    loss near ln C). Input float ``[B,3,32,32]``, output logits ``[B, num_classes]``."""
    w = width
    return nn.Sequential(
        OrderedDict(
            prep=conv_bn(3, w),
            layer1=conv_bn(w, 2 * w, pool=True),
            res1=Residual(nn.Sequential(conv_bn(2 * w, 2 * w), conv_bn(2 * w, 2 * w))),
            layer2=conv_bn(2 * w, 4 * w, pool=True),
            layer3=conv_bn(4 * w, 8 * w, pool=True),
            res3=Residual(nn.Sequential(conv_bn(8 * w, 8 * w), conv_bn(8 * w, 8 * w))),
            pool=GlobalMaxPool(),
            flatten=nn.Flatten(),
            fc=nn.Linear(8 * w, num_classes),
            scale=Scale(0.125),
        )
    )


def _two_column(
    num_classes: int, dropout: float, conv1: nn.Conv2d, pad: int, tail: list, fc_in: int, fc: int
) -> nn.Sequential:
    """The two-column layout both sizes share: ``conv1`` (3 -> 96 kernels), grouped conv2/4/5, LRN after
    conv1/2 (max-pools padded by ``pad``), ``tail`` after conv5's pool, then ``fc_in`` -> ``fc`` ->
    ``fc`` -> ``num_classes`` fully connected layers with dropout."""
    lrn = lambda: nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=2.0)  # noqa: E731
    relu = lambda: nn.ReLU(inplace=True)  # noqa: E731
    return nn.Sequential(
        OrderedDict(
            conv1=nn.Sequential(conv1, relu(), lrn(), nn.MaxPool2d(3, 2, pad)),
            conv2=nn.Sequential(
                nn.Conv2d(96, 256, 5, padding=2, groups=2), relu(), lrn(), nn.MaxPool2d(3, 2, pad)
            ),
            conv3=nn.Sequential(nn.Conv2d(256, 384, 3, padding=1), relu()),
            conv4=nn.Sequential(nn.Conv2d(384, 384, 3, padding=1, groups=2), relu()),
            conv5=nn.Sequential(
                nn.Conv2d(384, 256, 3, padding=1, groups=2), relu(), nn.MaxPool2d(3, 2), *tail, nn.Flatten()
            ),
            fc6=nn.Sequential(nn.Dropout(dropout), nn.Linear(fc_in, fc), relu()),
            fc7=nn.Sequential(nn.Dropout(dropout), nn.Linear(fc, fc), relu()),
            fc8=nn.Linear(fc, num_classes),
        )
    )


def mariana_cnn(num_classes: int = 1000, dropout: float = 0.5) -> nn.Sequential:
    """Two-column AlexNet (Krizhevsky et al. 2012) for 224 px input: float ``[B,3,224,224]`` ->
    logits ``[B, num_classes]``; ~61 M parameters at 1000 classes."""
    conv1 = nn.Conv2d(3, 96, 11, stride=4, padding=2)
    return _two_column(num_classes, dropout, conv1, 0, [nn.AdaptiveAvgPool2d(6)], 256 * 36, 4096)


def mariana_cnn_32(num_classes: int = 10, dropout: float = 0.5) -> nn.Sequential:
    """The two-column network at 32 px (CIFAR): the paper's kernel counts with 5x5/3x3 kernels at stride 1
    and 512-512 FC units (the 224 px widths would put 60 % of the weights in one layer). Float
    ``[B,3,32,32]`` -> logits ``[B, num_classes]``; ~3.8 M parameters."""
    return _two_column(num_classes, dropout, nn.Conv2d(3, 96, 5, padding=2), 1, [], 256 * 9, 512)


# The models of this app, by name (`mariana.platform.core.registry`): factory(num_classes, image_size, dropout).
@register_model("vision", "mariana-cnn")
def _mariana_cnn(num_classes: int, image_size: int = 32, dropout: float = 0.5) -> nn.Module:
    """The 224 px variant when ``image_size`` >= 128, else the 32 px one."""
    return mariana_cnn(num_classes, dropout) if image_size >= 128 else mariana_cnn_32(num_classes, dropout)


@register_model("vision", "mariana-cnn-32")
def _mariana_cnn_32(num_classes: int, image_size: int = 32, dropout: float = 0.5) -> nn.Module:
    return mariana_cnn_32(num_classes, dropout)


@register_model("vision", "cifar-fast")
def _cifar_fast(num_classes: int, image_size: int = 32, dropout: float = 0.5) -> nn.Module:
    return resnet9_layout(num_classes, width=16)


@register_model("vision", "resnet9")
def _resnet9(num_classes: int, image_size: int = 32, dropout: float = 0.5) -> nn.Module:
    return resnet9_layout(num_classes, width=64)


@register_model("vision", "fastnet")
def _fastnet(num_classes: int, image_size: int = 32, dropout: float = 0.5) -> nn.Module:
    return fastnet(num_classes)


MARIANA_MODELS = tuple(list_models("vision"))


def build_model(name: str, num_classes: int, image_size: int = 32, dropout: float = 0.5) -> nn.Module:
    """Model by name: one registered above (``mariana-cnn``, ``mariana-cnn-32``, ``cifar-fast``,
    ``resnet9``, ``fastnet``) or any torchvision classification model (``resnet18``, ``alexnet``, ...;
    randomly initialised). Raises MarianaError for an unknown name."""
    if name in MARIANA_MODELS:
        return create_model("vision", name, num_classes=num_classes, image_size=image_size, dropout=dropout)
    import torchvision

    known = torchvision.models.list_models(module=torchvision.models)
    if name not in known:
        raise MarianaError(
            f"unknown model {name!r}: choose one of {', '.join(MARIANA_MODELS)} or a torchvision model "
            f"({', '.join(sorted(known)[:8])}, ...)"
        )
    kwargs = {"num_classes": num_classes, "weights": None}
    if name.startswith("inception") or name.startswith("googlenet"):
        kwargs.update(aux_logits=False, init_weights=True)
    return torchvision.models.get_model(name, **kwargs)


def as_blocks(model: nn.Module) -> nn.Sequential:
    """The model as an ordered ``nn.Sequential`` of blocks computing the same function (parameters are
    shared, not copied). Supports Sequentials, torchvision ResNet/AlexNet/VGG-style models; raises
    MarianaError for models whose forward is not a simple chain."""
    if isinstance(model, nn.Sequential):
        return model
    import torchvision.models as tvm

    if isinstance(model, tvm.ResNet):
        names = ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool"]
        blocks = [(n, getattr(model, n)) for n in names]
        return nn.Sequential(OrderedDict(blocks + [("flatten", nn.Flatten()), ("fc", model.fc)]))
    if isinstance(model, tvm.AlexNet | tvm.VGG):
        blocks = [(f"features_{i}", m) for i, m in enumerate(model.features)]
        blocks += [("avgpool", model.avgpool), ("flatten", nn.Flatten())]
        blocks += [(f"classifier_{i}", m) for i, m in enumerate(model.classifier)]
        return nn.Sequential(OrderedDict(blocks))
    raise MarianaError(
        f"{type(model).__name__} cannot be split into pipeline stages (its forward is not a chain of blocks); "
        "use --model-parallel 1 or a model listed in apps/vision/model.py:as_blocks"
    )


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def check_input_size(model: nn.Module, name: str, image_size: int) -> None:
    """One forward pass of a zero image [1,3,S,S] in eval mode (no RNG drawn, no state changed), so that a
    model that cannot take S px input (e.g. ``alexnet`` at 32 px) fails here with a clear `MarianaError`
    (naming --model ``name``) instead of a shape error inside the training loop."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(1, 3, image_size, image_size))
    except RuntimeError as e:
        raise MarianaError(
            f"--model {name} cannot take {image_size} px images ({str(e).splitlines()[0][:160]}); "
            "raise --image-size (224 for ImageNet models) or pick a CIFAR model (cifar-fast, resnet9, mariana-cnn-32)"
        ) from None
    finally:
        model.train(was)
