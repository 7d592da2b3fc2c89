"""``mariana vision train|eval|classify`` (stdlib-only imports at module level)."""

from __future__ import annotations

import argparse


def _headline(m: dict) -> str:
    if "eval_top1" in m:
        return f"top-1 {m['eval_top1']:.2f}% top-5 {m.get('eval_top5', float('nan')):.2f}%"
    return f"train loss {m.get('train_loss', float('nan')):.4f}"


def _train(args, argv):
    from mariana.platform.cli.common import run_training

    from .configs import PRESETS, VisionConfig
    from .train import train

    return run_training(args, argv, VisionConfig, PRESETS, train, _headline, optional_paths=("eval_data",))


def _eval(args, argv):
    from mariana.platform.cli.common import check_data_path

    from .evaluate import evaluate_run

    check_data_path(args.data)
    check_data_path(args.model, "--model")
    r = evaluate_run(args.model, args.data, args.batch_size, args.device, args.num_workers)
    if r["skipped"]:
        print(f"skipped {r['skipped']} corrupt image(s), e.g. {', '.join(r['skipped_paths'][:3])}")
    print(f"images {r['images']}")
    print(f"top-1 {r['top1']:.2f}% top-5 {r['top5']:.2f}%")
    return 0


def _classify(args, argv):
    from mariana.platform.cli.common import check_data_path
    from mariana.platform.core.errors import MarianaError

    from .predict import load_classifier

    check_data_path(args.model, "--model")
    clf = load_classifier(args.model, "cpu" if args.device == "auto" else args.device)
    failed = 0
    for path in args.images:
        try:
            top = clf.classify_file(path, args.k)
        except MarianaError as e:
            print(f"error: {e}")
            failed += 1
            continue
        print(f"{path}: " + ", ".join(f"{label} {p:.3f}" for label, p in top))
    return 2 if failed == len(args.images) else 0


def register(sub) -> None:
    from mariana.platform.cli.common import add_train_parser

    from .configs import VisionConfig

    grp = sub.add_parser("vision", help="image classification (CNNs; data + pipeline model parallel)")
    g = grp.add_subparsers(dest="vision_command", required=True, metavar="COMMAND")
    add_train_parser(
        g,
        "train",
        VisionConfig,
        "train an image classifier on an ImageFolder tar/folder (--workers N --model-parallel K)",
        _train,
    )
    fmt = argparse.ArgumentDefaultsHelpFormatter
    e = g.add_parser(
        "eval", help="top-1/top-5 accuracy of a trained run on held-out images", formatter_class=fmt
    )
    e.add_argument("--model", required=True, help="run directory of a finished `mariana vision train`")
    e.add_argument(
        "--data", required=True, help="held-out images: a .tar shard or a folder [split/]CLASS/NAME.jpg"
    )
    e.add_argument("--batch-size", type=int, default=256, help="images per forward pass")
    e.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="compute device")
    e.add_argument("--num-workers", type=int, default=0, help="data-loader worker processes (read + decode)")
    e.set_defaults(func=_eval)
    c = g.add_parser("classify", help="print the top-5 labels of image files", formatter_class=fmt)
    c.add_argument("--model", required=True, help="run directory of a finished `mariana vision train`")
    c.add_argument("images", nargs="+", help="image files (JPEG/PNG)")
    c.add_argument("-k", type=int, default=5, help="labels to print per image")
    c.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="compute device (auto = cpu)"
    )
    c.add_argument("--data", default="", help="unused; accepted for uniformity with the other commands")
    c.set_defaults(func=_classify)
