"""The one Trainer's components: early stopping keeps and exports the best step's weights, warm start
begins where the source model ended, gradient accumulation equals one large batch, evaluation cadence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import DATA
from mariana.platform.core.config import TrainConfig
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.evaluator import EPOCH, Evaluator, auc_logloss, higher_is_better
from mariana.platform.core.loop import Trainer
from mariana.platform.core.rundir import RunDir
from mariana.platform.core.steps import ModuleStep
from mariana.platform.runtime.dist import DistContext
from sklearn.metrics import log_loss, roc_auc_score
from trained_runs import FRAPPE_DEEPFM, cli_here, train

FRAPPE = DATA / "frappe" / "frappe.validation.libfm"


class Loader:
    """Fixed regression batches: epoch e, batch b -> the same tensors on every call."""

    def __init__(self, n_batches: int, batch: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n_batches, batch, 4, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1
        self.batches_per_epoch = n_batches

    def iterate(self, epoch: int, start: int = 0):
        for b in range(start, self.batches_per_epoch):
            yield self.x[b], self.y[b]


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).squeeze(-1), y), len(y)


def make(cfg: TrainConfig, run, loader, evaluator=None, exporter=None, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    ctx = DistContext()
    step = ModuleStep(cfg, model, mse, ctx)
    return model, Trainer(cfg, step, loader, ctx, RunDir(run), evaluator=evaluator, exporter=exporter)


def cfg_(tmp_path, **kw) -> TrainConfig:
    return replace(TrainConfig(), out=str(tmp_path), optimizer="sgd", lr=0.05, progress=False, **kw)


def test_early_stop_exports_the_best_steps_weights(tmp_path):
    # the scripted validation metric improves until step 4, then gets worse: the exported weights must be
    # those after exactly 4 steps, and training stops after `patience` worse evaluations (step 8)
    scores = {2: 0.70, 4: 0.80, 6: 0.75, 8: 0.74, 10: 0.9}
    snapshots: dict[int, dict] = {}
    model = None

    def fn(m):
        return {"auc": scores[trainer.step]}

    def export(metrics, step):
        snapshots["exported"] = {k: v.clone() for k, v in model.state_dict().items()}
        snapshots["at"] = step
        snapshots["metrics"] = metrics

    ev = Evaluator(fn, every=2, monitor="auc", patience=2)
    cfg = cfg_(tmp_path / "a", max_steps=10)
    model, trainer = make(cfg, tmp_path / "a", Loader(20, 8), ev, export)
    final = trainer.fit()
    assert final["steps"] == 8 and final["stopped_early"]
    assert final["best_step"] == 4 and final["best_eval_auc"] == pytest.approx(0.80)
    assert snapshots["at"] == 4 and snapshots["metrics"]["eval_auc"] == pytest.approx(0.80)
    saved = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert saved["best_step"] == 4 and saved["exported_step"] == 4

    ref_model, ref = make(cfg_(tmp_path / "b", max_steps=4), tmp_path / "b", Loader(20, 8))
    ref.fit()
    for k, v in ref_model.state_dict().items():
        torch.testing.assert_close(snapshots["exported"][k], v, rtol=0, atol=0)
    assert not torch.equal(snapshots["exported"]["weight"], model.state_dict()["weight"])  # it trained on


def test_preemption_signal_after_the_loop_lets_the_run_finish(tmp_path, monkeypatch):
    """Under Slurm (MARIANA_PREEMPTIBLE=1) a SIGTERM that comes after the last step, during the final
    export, is noted and the run ends normally: its handler was still armed. (It used to be the default
    again there, so the process died with 143 and Slurm requeued a finished run, which then could not resume:
    test_slurm_requeue's time-limited job, twice on 2026-12-06/07.)"""
    monkeypatch.setenv("MARIANA_PREEMPTIBLE", "1")
    hits = []
    before = signal.signal(signal.SIGTERM, lambda *_: hits.append("the handler restored too early"))
    try:

        def export(metrics, step):
            os.kill(os.getpid(), signal.SIGTERM)

        _, trainer = make(cfg_(tmp_path, max_steps=6), tmp_path, Loader(3, 4), exporter=export)
        final = trainer.fit()
        assert final["steps"] == 6 and trainer.signalled == "SIGTERM" and not hits, (final, hits)
        assert signal.getsignal(signal.SIGTERM) is not None and not hits
    finally:
        signal.signal(signal.SIGTERM, before)


def test_auc_and_logloss_equal_scikit_learns_with_ties_and_clipped_extremes():
    rng = np.random.default_rng(0)
    for n in (2, 7, 100, 5000):
        y = rng.integers(0, 2, n)
        y[:2] = [0, 1]
        for p in (rng.random(n), np.round(rng.random(n), 1), np.r_[np.zeros(n - n // 2), np.ones(n // 2)]):
            m, clipped = auc_logloss(y, p), np.clip(p, 1e-7, 1 - 1e-7)
            assert abs(m["auc"] - roc_auc_score(y, clipped)) < 1e-12, (n, m)
            assert abs(m["logloss"] - log_loss(y, clipped, labels=[0, 1])) < 1e-12, (n, m)
    assert np.isnan(auc_logloss(np.ones(3), np.ones(3))["auc"]) and np.isnan(auc_logloss([], [])["logloss"])
    # the point of our own: evaluating does not import scikit-learn (1.5 s of CPU in each process)
    code = "import sys; from mariana.platform.core.evaluator import auc_logloss as f; f([0, 1], [0.2, 0.9]); "
    code += "assert 'sklearn' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lower_is_better_metrics_and_unknown_monitor():
    assert higher_is_better("val_auc") and higher_is_better("top1")
    assert not higher_is_better("eval_logloss") and not higher_is_better("wer")
    with pytest.raises(MarianaError, match="unknown metric"):
        higher_is_better("banana")
    ev = Evaluator(lambda m: {}, every=1, monitor="wer", patience=1)
    assert ev.record(1, {"wer": 10.0}) and ev.record(2, {"wer": 9.0}) and not ev.record(3, {"wer": 9.5})
    assert ev.should_stop and ev.best_step == 2
    with pytest.raises(MarianaError, match="no such metric"):
        ev.record(4, {"auc": 0.5})


def test_eval_every_epoch_evaluates_at_each_epoch_end(tmp_path):
    steps = []
    ev = Evaluator(lambda m: steps.append(trainer.step) or {"loss": 1.0}, every=EPOCH, monitor="loss")
    _, trainer = make(cfg_(tmp_path, epochs=3), tmp_path, Loader(5, 4), ev)
    trainer.fit()
    assert steps == [5, 10, 15]
    epochs = [
        json.loads(line)["epoch"] for line in (tmp_path / "metrics.jsonl").open() if "eval_loss" in line
    ]
    assert epochs == [0, 1, 2]


def test_eval_log_line_prints_counts_as_integers(tmp_path):
    """A count among the metrics (vision's "images") reads "images 200", not "images 200.0000" (issue 30)."""
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())
    logger = logging.getLogger("mariana")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        ev = Evaluator(lambda m: {"top1": 12.5, "images": 200}, every=EPOCH, monitor="top1")
        _, trainer = make(cfg_(tmp_path, epochs=1), tmp_path, Loader(2, 4), ev)
        trainer.fit()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    shown = [x for x in lines if "eval top1" in x]
    assert shown and "top1 12.5000 images 200" in shown[0] and "200.0000" not in shown[0], shown


def test_grad_accum_equals_one_large_batch(tmp_path):
    big = Loader(4, 16)
    small = Loader(8, 8)
    small.x, small.y = big.x.reshape(8, 8, 4), big.y.reshape(8, 8)  # the same samples in halves
    m1, t1 = make(cfg_(tmp_path / "one", max_steps=3), tmp_path / "one", big)
    m2, t2 = make(cfg_(tmp_path / "acc", max_steps=3, grad_accum=2), tmp_path / "acc", small)
    t1.fit()
    t2.fit()
    for (k, a), b in zip(m1.state_dict().items(), m2.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=k)


@pytest.mark.slow
def test_warm_start_begins_at_the_source_models_evaluation(tmp_path):
    base = ["mlp", "train", "--data", FRAPPE, "--preset", "debug", "--max-steps", "30"]
    train(base, tmp_path / "src")  # the source in this process (`trained_runs.train`): only its model is used
    src = json.loads((tmp_path / "src" / "metrics.json").read_text())
    cli_here(
        [*base, "--out", tmp_path / "warm", "--init-from", tmp_path / "src", "--eval-every", "10"], check=True
    )
    recs = [json.loads(line) for line in (tmp_path / "warm" / "metrics.jsonl").open()]
    first = next(r for r in recs if "eval_auc" in r)
    assert first["step"] == 0
    assert first["eval_auc"] == pytest.approx(src["eval_auc"], abs=1e-9)
    assert first["eval_logloss"] == pytest.approx(src["eval_logloss"], abs=1e-9)
    bad = cli_here([*base, "--out", tmp_path / "bad", "--init-from", tmp_path / "src", "--hidden", "8"])
    assert bad.returncode == 2 and "--init-from" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_pctr_warm_start_and_best_model_export(frappe_deepfm, tmp_path):
    """The source is the shared `trained_runs.FRAPPE_DEEPFM`: 60 steps evaluated every 20, without early
    stopping (the debug preset's --early-stop 0); the warm start reads it, its own --out is new."""
    base, source = FRAPPE_DEEPFM, frappe_deepfm.path
    src = json.loads((source / "metrics.json").read_text())
    meta = json.loads((source / "model.json").read_text())
    assert meta["metrics"]["step"] == src["best_step"]  # the exported model is the best evaluated one
    best = next(h for h in src["epochs"] if h["step"] == src["best_step"])
    assert best["eval_auc"] == max(h["eval_auc"] for h in src["epochs"])
    cli_here([*base, "--out", tmp_path / "warm", "--init-from", source, "--init-row-state"], check=True)
    recs = [json.loads(line) for line in (tmp_path / "warm" / "metrics.jsonl").open()]
    first = next(r for r in recs if "eval_auc" in r)
    assert first["step"] == 0 and first["eval_auc"] == pytest.approx(best["eval_auc"], abs=1e-9)
