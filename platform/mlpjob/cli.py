"""``mariana mlp train|eval``: the platform's smoke-test job (a small click MLP on libFM data)."""

from __future__ import annotations

import argparse


def _train(args, argv):
    from ..cli.common import run_training
    from .configs import PRESETS, MlpConfig
    from .train import train

    return run_training(
        args,
        argv,
        MlpConfig,
        PRESETS,
        train,
        lambda m: (
            f"validation AUC {m.get('eval_auc', float('nan')):.4f} logloss {m.get('eval_logloss', float('nan')):.4f}"
        ),
    )


def _eval(args, argv):
    from ..cli.common import check_data_path
    from .evaluate import evaluate_run

    check_data_path(args.data)
    check_data_path(args.model, "--model")
    r = evaluate_run(args.model, args.data)
    print(f"AUC {r['auc']:.4f} logloss {r['logloss']:.4f}")
    return 0


def register(sub) -> None:
    from ..cli.common import add_train_parser
    from .configs import MlpConfig

    grp = sub.add_parser("mlp", help="smoke-test job: a small click MLP on libFM data (data-parallel demo)")
    g = grp.add_subparsers(dest="mlp_command", required=True, metavar="COMMAND")
    add_train_parser(g, "train", MlpConfig, "train the click MLP with synchronous data-parallel SGD", _train)
    e = g.add_parser(
        "eval",
        help="AUC/logloss of an exported run on a libFM file",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    e.add_argument("--model", required=True, help="run directory of a finished `mariana mlp train`")
    e.add_argument("--data", required=True, help="libFM file to score")
    e.set_defaults(func=_eval)
