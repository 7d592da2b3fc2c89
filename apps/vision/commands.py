"""Handlers of ``mariana vision train|eval|classify`` (parsers: `cli.py`; torch and the model code imported
at the top), loaded by `mariana.platform.cli.dispatch` only when one of them runs."""

from __future__ import annotations

import argparse
import sys

from mariana.platform.cli.common import check_data_path, run_training
from mariana.platform.cli.console import warn_skipped
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.rundir import eval_result_path
from mariana.platform.runtime.dist import resolve_device

from .configs import PRESETS, VisionConfig
from .evaluate import evaluate_run
from .predict import load_classifier
from .train import train as train_run


def headline(m: dict) -> str:
    """The last line of ``vision train``: top-1/top-5 when the run evaluated, else the training loss."""
    if "eval_top1" in m:
        return f"top-1 {m['eval_top1']:.2f}% top-5 {m.get('eval_top5', float('nan')):.2f}%"
    return f"train loss {m.get('train_loss', float('nan')):.4f}"


def train(args: argparse.Namespace, argv: list[str]) -> int:
    """``vision train`` (`run_training`); --eval-data must exist when given."""
    return run_training(args, argv, VisionConfig, PRESETS, train_run, headline, optional_paths=("eval_data",))


def evaluate(args: argparse.Namespace, argv: list[str]) -> int:
    """``vision eval``: top-1/top-5 of the run --model on --data, written to RUN/eval/<data name>.json."""
    if args.batch_size < 1:
        raise MarianaError(f"--batch-size must be >= 1 image, got {args.batch_size}")
    if args.num_workers < 0:
        raise MarianaError(f"--num-workers must be >= 0 (0 = read in this process), got {args.num_workers}")
    if args.limit < 0:
        raise MarianaError(f"--limit must be >= 0 images (0 = all), got {args.limit}")
    check_data_path(args.data)
    check_data_path(args.model, "--model")
    out = eval_result_path(args.model, args.data)
    r = evaluate_run(
        args.model, args.data, args.batch_size, args.device, args.num_workers, out, args.tta, args.limit
    )
    warn_skipped(
        args.data, r["skipped"], [(p, "not a decodable image") for p in r["skipped_paths"]], "corrupt image"
    )
    print(f"images {r['images']}; result written to {out}")
    tta = f" ({args.tta} TTA)" if args.tta != "none" else ""
    print(f"top-1 {r['top1']:.2f}% top-5 {r['top5']:.2f}%{tta}")
    return 0


def classify(args: argparse.Namespace, argv: list[str]) -> int:
    """``vision classify``: ``PATH: label p, ...`` (the top -k labels) per image; a bad file is reported
    on stderr and skipped, and any failure makes the exit status 2."""
    if args.k is not None and args.k < 1:
        raise MarianaError(f"-k must be >= 1 label, got {args.k}")
    check_data_path(args.model, "--model")
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
