"""``mariana vision train|eval|classify``: the parsers only (standard library, the CLI helpers and
`configs`, so ``mariana vision --help`` imports neither torch nor numpy). Each leaf names its handler in
`mariana.apps.vision.commands` with `dispatch.handler`, imported only when that command runs."""

from __future__ import annotations

import argparse

from mariana.platform.cli.common import DefaultsHelpFormatter, add_train_parser
from mariana.platform.cli.dispatch import handler

from .configs import PRESETS, VisionConfig

_FMT = DefaultsHelpFormatter


def _tta_flags(p: argparse.ArgumentParser) -> None:
    """``--tta`` (= ``--tta-mode flip``) and ``--tta-mode {none,flip,crops}``, both into ``args.tta``."""
    p.add_argument(
        "--tta",
        action="store_const",
        const="flip",
        default="none",
        help="test-time augmentation: average each image's and its mirror image's probabilities (2x compute)",
    )
    p.add_argument(
        "--tta-mode",
        dest="tta",
        choices=["none", "flip", "crops"],
        help="test-time augmentation views, probabilities averaged: flip (2) or crops (flip + 1 px "
        "translations up-left and down-right: 6, as the fast preset evaluates)",
    )


def register(sub) -> None:
    """The ``vision`` group and its leaf commands under the ``mariana`` subparsers ``sub``."""
    grp = sub.add_parser("vision", help="image classification (CNNs; data + pipeline model parallel)")
    g = grp.add_subparsers(dest="vision_command", required=True, metavar="COMMAND")
    add_train_parser(
        g,
        "train",
        VisionConfig,
        "train an image classifier on an ImageFolder tar/folder (--workers N --model-parallel K)",
        handler("mariana.apps.vision.commands:train"),
        PRESETS,
    )
    e = g.add_parser(
        "eval",
        help="top-1/top-5 accuracy of a trained run on held-out images (-> RUN/eval/<data name>.json)",
        formatter_class=_FMT,
    )
    e.add_argument("--model", required=True, help="run directory of a finished `mariana vision train`")
    e.add_argument(
        "--data", required=True, help="held-out images: a .tar shard or a folder [split/]CLASS/NAME.jpg"
    )
    e.add_argument("--batch-size", type=int, default=256, help="images per forward pass")
    e.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="compute device")
    e.add_argument("--num-workers", type=int, default=0, help="data-loader worker processes (read + decode)")
    e.add_argument(
        "--limit", type=int, default=0, help="the first N images of a fixed random order (0 = all)"
    )
    _tta_flags(e)
    e.set_defaults(func=handler("mariana.apps.vision.commands:evaluate"))
    c = g.add_parser("classify", help="print the top-k labels of image files", formatter_class=_FMT)
    c.add_argument("--model", required=True, help="run directory of a finished `mariana vision train`")
    c.add_argument("images", nargs="+", help="image files (JPEG/PNG)")
    c.add_argument(
        "-k",
        type=int,
        default=None,
        help="labels to print per image, 1..classes (default: 5 or all classes if fewer)",
    )
    c.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="compute device (auto = cpu)"
    )
    _tta_flags(c)
    c.set_defaults(func=handler("mariana.apps.vision.commands:classify"))
