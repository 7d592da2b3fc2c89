"""No host reads inside a training step: every app's training runs a few steps under the host-read audit
(``MARIANA_AUDIT_HOST_READS``, `mariana.platform.core.hostreads`, in every worker process) and only log /
eval / checkpoint steps may read a tensor of the step back to the host. The audit catches a planted
``.item()``; on CUDA, ``torch.cuda.set_sync_debug_mode("error")`` makes any sync in the ASR step fail."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from helpers import DATA, ROOT, run_cli
from mariana.platform.core import hostreads
from test_app_registry import _asr_data
from trained_runs import cli_here

FRAPPE = DATA / "frappe" / "frappe.validation.libfm"
CIFAR = DATA / "cifar10" / "train.tar"
STEPS = ["--max-steps", "6", "--log-every", "3", "--no-progress"]

CASES = {
    "mlp": lambda d: ["mlp", "train", "--data", FRAPPE, "--preset", "debug"],
    "asr": lambda d: (
        ["asr", "train", "--data", _asr_data(d), "--preset", "debug"]
        + ["--time-stretch", "0.8,1.2", "--spec-augment"]
    ),
    "vision-dp": lambda d: (
        ["vision", "train", "--data", CIFAR, "--preset", "debug", "--limit", "64"] + ["--workers", "2"]
    ),
    "vision-pipeline": lambda d: (
        ["vision", "train", "--data", CIFAR, "--preset", "debug", "--limit", "64"]
        + ["--workers", "2", "--model-parallel", "2", "--micro-batches", "2"]
    ),
    "pctr": lambda d: (
        ["pctr", "train", "--data", FRAPPE, "--format", "libfm", "--preset", "debug"] + ["--ids", "hash"]
    ),
}


@pytest.mark.parametrize("app", list(CASES))
def test_training_steps_read_nothing_back_outside_log_eval_ckpt_steps(app, tmp_path):
    audit = tmp_path / "audit"
    args = CASES[app](tmp_path)
    argv, env = [*args, *STEPS, "--out", tmp_path / "run"], {hostreads.ENV: str(audit)}
    # several workers: torchrun's agent and its processes; one process: this one (`cli_here`)
    if "--workers" in args:
        run_cli(argv, env=env, timeout=240, check=True)
    else:
        cli_here(argv, env=env, check=True)
    recs = hostreads.records(audit)
    ranks = 2 if "--workers" in args else 1
    assert sorted({r["rank"] for r in recs}) == list(range(ranks))
    for rank in range(ranks):  # every step of every rank audited, the log steps marked
        mine = [r for r in recs if r["rank"] == rank]
        assert [r["step"] for r in mine] == list(range(1, 7))
        assert [r["step"] for r in mine if r["log"]] == [3, 6]
    assert hostreads.violations(audit) == []


def test_audit_catches_a_planted_item(tmp_path, monkeypatch):
    # The mlp job in this process, its loss function reading the loss back every step: every step that
    # is no log step is a violation, and the record names the read and where it happened.
    from mariana.apps.mlp import train as mlp_train
    from mariana.apps.mlp.configs import PRESETS

    real = mlp_train.step_fn

    def reading_step(model, batch):
        loss, n = real(model, batch)
        loss.item()  # the planted host read
        return loss, n

    monkeypatch.setattr(mlp_train, "step_fn", reading_step)
    monkeypatch.setenv(hostreads.ENV, str(tmp_path / "audit"))
    cfg = dataclasses.replace(
        PRESETS["debug"],
        data=str(FRAPPE),
        out=str(tmp_path / "run"),
        max_steps=4,
        log_every=2,
        progress=False,
    )
    mlp_train.train(cfg)
    bad = hostreads.violations(tmp_path / "audit")
    assert [r["step"] for r in bad] == [1, 3]
    assert all(r["reads"] == {"item": 1} and "test_host_reads.py" in r["where"][0] for r in bad)


def test_audit_counts_data_dependent_sizes_only_on_tensors_of_the_step(tmp_path):
    outside = torch.tensor([1.0, 0.0, 2.0])
    audit = hostreads.HostReadAudit(tmp_path)
    audit.begin()
    with audit:
        outside.tolist(), outside.numpy()  # made before the step (the loader's host sizes): free to read
        x = outside * 2
        x[x > 0], x.nonzero(), torch.unique(x), torch.masked_select(x, x > 1), int(x[0]), x.cpu()
    audit.end(1, False, False, False)
    rec = json.loads((tmp_path / "rank0.jsonl").read_text())
    assert rec["reads"] == {
        "bool_mask_index": 1,
        "nonzero": 1,
        "unique": 1,
        "masked_select": 1,
        "__int__": 1,
        "cpu": 1,
    }


@pytest.mark.gpu
@pytest.mark.parametrize("compile_", [False, None], ids=["eager", "default-compiled"])
def test_asr_step_runs_under_cuda_sync_debug_error(tmp_path, compile_):
    # A sync in the step (a device read, a blocking copy, a data-dependent size) raises under "error";
    # eager and as training runs it by default on a GPU (compiled).
    sys.path.insert(0, str(ROOT / "bench"))
    from asr_throughput import Ours, sync_check
    from mariana.apps.asr.configs import PRESETS
    from mariana.apps.asr.features import UtteranceSet, cached_features, feature_settings
    from mariana.apps.asr.train import BLANK

    data = _asr_data(tmp_path)
    cfg = dataclasses.replace(
        PRESETS["small"], batch_size=4, time_stretch=[0.8, 1.2], device="cuda", compile=compile_
    )
    cache = cached_features(data / "train", feature_settings(cfg), 1)
    vocab = [BLANK] + sorted({w for u in cache.utts for w in u["words"]})
    ours = Ours(cfg, UtteranceSet(cache, vocab), torch.device("cuda"), len(vocab))
    assert ours.tier == "device"
    assert sync_check(ours) == "passed"
