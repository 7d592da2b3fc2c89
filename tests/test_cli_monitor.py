"""Issue 30.11 (--monitor): a metric the job's evaluation does not report is refused before training,
in one line (it used to fail only after the whole run, exporting nothing). Generated over every train
command with --monitor: each is given a known metric its evaluation lacks, and its own headline metric
must be among those it declares."""

import time

import pytest
from cliwalk import leaf_parsers, option, run_main
from mariana.platform.core.evaluator import HIGHER_IS_BETTER

TRAIN = [p for p, parser in leaf_parsers() if option(parser, "--monitor") and p[-1] == "train"]
CONFIGS = {
    ("mlp", "train"): "mariana.apps.mlp.configs:MlpConfig",
    ("asr", "train"): "mariana.apps.asr.configs:AsrConfig",
    ("vision", "train"): "mariana.apps.vision.configs:VisionConfig",
    ("pctr", "train"): "mariana.apps.pctr.configs:PctrConfig",
}
HEADLINE = {"mlp": "auc", "asr": "wer", "vision": "top1", "pctr": "auc"}


def _cls(path):
    import importlib

    mod, name = CONFIGS[path].split(":")
    return getattr(importlib.import_module(mod), name)


def test_every_train_command_is_listed():
    assert sorted(TRAIN) == sorted(CONFIGS)


@pytest.mark.parametrize("path", sorted(CONFIGS), ids=" ".join)
def test_unreported_monitor_is_refused_before_training(path, tmp_path, capsys):
    reported = _cls(path).EVAL_METRICS
    assert HEADLINE[path[0]] in reported
    wrong = next(m for m in sorted(HIGHER_IS_BETTER) if m not in reported)
    data = tmp_path / "d.txt"
    data.write_text("1 0:1\n")
    t0 = time.monotonic()
    # --monitor applies only where there is something to evaluate: held-out data where the job takes it
    held_out = ["--eval-data", data] if option(dict(leaf_parsers())[path], "--eval-data") else []
    argv = [*path, "--data", data, *held_out, "--out", tmp_path / "r", "--monitor", wrong]
    rc, out, err = run_main(argv, capsys)
    assert rc == 2 and f"--monitor {wrong}: the evaluation reports no such metric" in err, err
    assert time.monotonic() - t0 < 10 and not (tmp_path / "r").exists()
