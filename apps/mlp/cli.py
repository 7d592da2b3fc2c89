"""``mariana mlp train|eval``: the platform's smoke-test job (a small click MLP on libFM data)."""

from __future__ import annotations

import argparse
from pathlib import Path

from mariana.platform.core.errors import MarianaError


def _train(args, argv):
    from mariana.platform.cli.common import run_training

    from .configs import PRESETS, MlpConfig

    def train(cfg):
        from .train import train as train_mlp  # torch + sklearn: imported once the input is checked

        return train_mlp(cfg)

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
    from mariana.platform.cli.common import check_data_path

    check_data_path(args.data)
    check_data_path(args.model, "--model")
    _check_model_json(Path(args.model))
    from .evaluate import evaluate_run  # torch + sklearn: imported once the input is checked

    r = evaluate_run(args.model, args.data, args.split)
    print(
        f"AUC {r['auc']:.4f} logloss {r['logloss']:.4f} on {Path(args.data).name} ({args.split}, {r['rows']} rows)"
    )
    return 0


def _check_model_json(model: Path) -> None:
    """Fail fast (before torch is imported) when ``model`` is not a run of ``mariana mlp train``: no
    weights file, or its ``model.json`` names another app. `evaluate_run` checks the weights file's own metadata again."""
    import json

    weights = model / "model.safetensors" if model.is_dir() else model
    if not weights.is_file():
        raise MarianaError(
            f"no exported model at {weights} (train first, or point --model at a run directory)"
        )
    meta_path = weights.with_name("model.json")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return  # no readable model.json: load_exported reports the weights file
    app = meta.get("app") or meta.get("job") if isinstance(meta, dict) else None
    if app != "mlp":
        found = f"a {app!r} model" if app else "a model without an app name"
        raise MarianaError(
            f"--model {model}: its model.json describes {found}, not one of `mariana mlp train`"
        )


def register(sub) -> None:
    from mariana.platform.cli.common import add_train_parser

    from .configs import PRESETS, MlpConfig

    grp = sub.add_parser("mlp", help="smoke-test job: a small click MLP on libFM data (data-parallel demo)")
    g = grp.add_subparsers(dest="mlp_command", required=True, metavar="COMMAND")
    add_train_parser(
        g, "train", MlpConfig, "train the click MLP with synchronous data-parallel SGD", _train, PRESETS
    )
    e = g.add_parser(
        "eval",
        help="AUC/logloss of an exported run on a libFM file",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    e.add_argument("--model", required=True, help="run directory of a finished `mariana mlp train`")
    e.add_argument("--data", required=True, help="libFM file to score")
    e.add_argument(
        "--split",
        choices=["all", "train", "val", "test"],
        default="all",
        help="rows of --data to score: all, or the train/val/test rows of that file as `mlp train` split "
        "them (by row order: train | val | test, the run's --val-fraction and --test-fraction)",
    )
    e.set_defaults(func=_eval)
