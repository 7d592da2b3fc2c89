"""``mariana vision train|eval|classify`` (stdlib-only imports at module level)."""

from __future__ import annotations

import argparse

from mariana.platform.cli.console import warn_skipped


def _headline(m: dict) -> str:
    if "eval_top1" in m:
        return f"top-1 {m['eval_top1']:.2f}% top-5 {m.get('eval_top5', float('nan')):.2f}%"
    return f"train loss {m.get('train_loss', float('nan')):.4f}"


def _train(args, argv):
    from mariana.platform.cli.common import run_training

    from .configs import PRESETS, VisionConfig

    def train(cfg):  # torch is imported only once the config and paths passed their checks
        from .train import train as train_

        return train_(cfg)

    return run_training(args, argv, VisionConfig, PRESETS, train, _headline, optional_paths=("eval_data",))


def _eval(args, argv):
    from mariana.platform.cli.common import check_data_path
    from mariana.platform.core.errors import MarianaError
    from mariana.platform.core.rundir import eval_result_path

    # flags first: a typo fails before torch is imported
    if args.batch_size < 1:
        raise MarianaError(f"--batch-size must be >= 1 image, got {args.batch_size}")
    if args.num_workers < 0:
        raise MarianaError(f"--num-workers must be >= 0 (0 = read in this process), got {args.num_workers}")
    check_data_path(args.data)
    check_data_path(args.model, "--model")
    from .evaluate import evaluate_run

    out = eval_result_path(args.model, args.data)
    r = evaluate_run(args.model, args.data, args.batch_size, args.device, args.num_workers, out, args.tta)
    warn_skipped(
        args.data, r["skipped"], [(p, "not a decodable image") for p in r["skipped_paths"]], "corrupt image"
    )
    print(f"images {r['images']}; result written to {out}")
    tta = f" ({args.tta} TTA)" if args.tta != "none" else ""
    print(f"top-1 {r['top1']:.2f}% top-5 {r['top5']:.2f}%{tta}")
    return 0


def _classify(args, argv):
    import sys

    from mariana.platform.cli.common import check_data_path
    from mariana.platform.core.errors import MarianaError

    if args.k is not None and args.k < 1:
        raise MarianaError(f"-k must be >= 1 label, got {args.k}")
    check_data_path(args.model, "--model")
    from mariana.platform.runtime.dist import resolve_device

    from .predict import load_classifier

    clf = load_classifier(args.model, "cpu" if args.device == "auto" else resolve_device(args.device))
    n = len(clf.classes)
    if args.k is not None and args.k > n:
        raise MarianaError(f"-k {args.k}: the model knows only {n} classes (expected 1..{n})")
    k = args.k if args.k is not None else min(5, n)
    failed = 0
    for path in args.images:  # a bad file is reported and skipped; the others are still classified
        try:
            top = clf.classify_file(path, k, args.tta)
        except MarianaError as e:
            print(f"mariana: error: {e} (skipped)", file=sys.stderr, flush=True)
            failed += 1
            continue
        print(f"{path}: " + ", ".join(f"{label} {p:.3f}" for label, p in top), flush=True)
    if failed:  # a partial failure must not look like success to a script
        raise MarianaError(
            f"classified {len(args.images) - failed} of {len(args.images)} image(s): {failed} failed"
        )
    return 0


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` only where there is a default to show: not on required flags or positionals."""

    def _get_help_string(self, action):
        if action.required or action.default in (None, "") or action.nargs in ("+", "*"):
            return action.help
        return super()._get_help_string(action)


def _tta_flags(p) -> None:
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
    from mariana.platform.cli.common import add_train_parser

    from .configs import PRESETS, VisionConfig

    grp = sub.add_parser("vision", help="image classification (CNNs; data + pipeline model parallel)")
    g = grp.add_subparsers(dest="vision_command", required=True, metavar="COMMAND")
    add_train_parser(
        g,
        "train",
        VisionConfig,
        "train an image classifier on an ImageFolder tar/folder (--workers N --model-parallel K)",
        _train,
        PRESETS,
    )
    fmt = _HelpFormatter
    e = g.add_parser(
        "eval",
        help="top-1/top-5 accuracy of a trained run on held-out images (-> RUN/eval/<data name>.json)",
        formatter_class=fmt,
    )
    e.add_argument("--model", required=True, help="run directory of a finished `mariana vision train`")
    e.add_argument(
        "--data", required=True, help="held-out images: a .tar shard or a folder [split/]CLASS/NAME.jpg"
    )
    e.add_argument("--batch-size", type=int, default=256, help="images per forward pass")
    e.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="compute device")
    e.add_argument("--num-workers", type=int, default=0, help="data-loader worker processes (read + decode)")
    _tta_flags(e)
    e.set_defaults(func=_eval)
    c = g.add_parser("classify", help="print the top-k labels of image files", formatter_class=fmt)
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
    c.add_argument("--data", default="", help="unused; accepted for uniformity with the other commands")
    c.set_defaults(func=_classify)
