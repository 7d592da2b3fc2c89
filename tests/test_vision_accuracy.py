"""Accuracy regression: the ``small`` recipe (cifar-fast, one epoch over train.tar, decode-once cache,
2 CPU threads) trains in <= 5 minutes on 2 cores and reaches >= 60 % top-1 on test-dev.tar.

Measured alone: ~50 s of training, ~115 CPU-seconds for the whole command, 72 % top-1. The time limit is
checked both as the training loop's wall time and as the command's CPU time (<= 2 cores x 300 s), the
latter being immune to other jobs sharing the machine; the wall-time check is skipped when the load
average shows the cores were shared (more runnable jobs than cores)."""

from __future__ import annotations

import json
import os
import resource

import pytest
from helpers import DATA, last_line, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.accuracy]


def test_small_cnn_reaches_60_percent_on_cifar10(tmp_path):
    run = tmp_path / "run"
    cifar = DATA / "cifar10"
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = run_cli(
        [
            "vision",
            "train",
            "--preset",
            "small",
            "--data",
            cifar / "train.tar",
            "--out",
            run,
            "--device",
            "cpu",
            "--no-progress",
        ],
        timeout=600,
        env={"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    metrics = json.loads((run / "metrics.json").read_text())
    assert cpu_s <= 2 * 300, cpu_s  # the whole command (start-up, decode, train, eval) within 2 cores x 5 min
    print(f"training loop {metrics['wall_time_s']:.1f} s wall, command {cpu_s:.1f} CPU-s, load {load}")
    if max(load, os.getloadavg()[0]) <= (os.cpu_count() or 1) + 0.5:
        # wall time means something only when the cores were not shared with other jobs
        assert metrics["wall_time_s"] <= 300, metrics  # training loop time

    proc = run_cli(["vision", "eval", "--model", run, "--data", cifar / "test-dev.tar"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = last_line(proc.stdout)
    assert line.startswith("top-1 ")
    from mariana.platform.core.rundir import eval_result_path

    result = json.loads(eval_result_path(run, cifar / "test-dev.tar").read_text())
    assert result["images"] == 5000
    assert abs(float(line.split()[1].rstrip("%")) - result["top1"]) < 0.01
    assert result["top1"] >= 60.0, result
    assert result["top5"] >= result["top1"]
