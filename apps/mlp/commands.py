"""Handlers of ``mariana mlp train|eval`` (their parsers: `cli.py`). Imported only when one of these commands
runs (`mariana.platform.cli.dispatch`), so it imports the training code at its top."""

from __future__ import annotations

from pathlib import Path

from mariana.platform.cli.common import check_data_path, run_training
from mariana.platform.core.config import resolve_config
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.jsonfile import read_json

from .configs import PRESETS, MlpConfig, MlpEvalConfig
from .evaluate import evaluate_run
from .train import train as train_mlp


def _headline(m: dict) -> str:
    auc, logloss = m.get("eval_auc", float("nan")), m.get("eval_logloss", float("nan"))
    return f"validation AUC {auc:.4f} logloss {logloss:.4f}"


def train(args, argv) -> int:
    """``mariana mlp train``: resolve the config, check the input, train (launching workers if needed)."""
    return run_training(args, argv, MlpConfig, PRESETS, train_mlp, _headline)


def evaluate(args, argv) -> int:
    """``mariana mlp eval``: AUC/logloss of an exported run on (a split of) a libFM file."""
    cfg = resolve_config(MlpEvalConfig, args)
    check_data_path(cfg.data)
    check_data_path(cfg.model, "--model")
    _check_model_json(Path(cfg.model))
    r = evaluate_run(cfg.model, cfg.data, cfg.split)
    name = Path(cfg.data).name
    print(f"AUC {r['auc']:.4f} logloss {r['logloss']:.4f} on {name} ({cfg.split}, {r['rows']} rows)")
    return 0


def _check_model_json(model: Path) -> None:
    """Refuse ``model`` when it is not a run of ``mariana mlp train``: no weights file, or its ``model.json``
    names another app. `evaluate_run` checks the weights file's own metadata again."""
    weights = model / "model.safetensors" if model.is_dir() else model
    if not weights.is_file():
        raise MarianaError(
            f"no exported model at {weights} (train first, or point --model at a run directory)"
        )
    if (meta := read_json(weights.with_name("model.json"))) is None:
        return  # no readable model.json: load_exported reports the weights file
    app = meta.get("app") or meta.get("job") if isinstance(meta, dict) else None
    if app != "mlp":
        found = f"a {app!r} model" if app else "a model without an app name"
        raise MarianaError(
            f"--model {model}: its model.json describes {found}, not one of `mariana mlp train`"
        )
