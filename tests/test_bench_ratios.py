"""The benchmark scripts' headline arithmetic: the serving bench's sustainable rate and the pCTR bench's
per-epoch training rates from a run's metrics.jsonl (the one Trainer's log records)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(autouse=True)
def bench_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    yield
    for name in ("serving_latency", "pctr_throughput", "common"):
        sys.modules.pop(name, None)


def test_sustainable_rate_needs_every_lower_rate_to_pass():
    from serving_latency import sustainable

    def row(rate, p99, errors=0):
        return {"rate": rate, "p99_ms": p99, "errors": errors}

    ladder = [row(250, 3.0), row(100, 2.0), row(500, 12.0), row(750, 9.0), row(1000, 8.0)]
    assert sustainable(ladder, 10.0) == 250  # 750 and 1000 passed, but 500 failed below them
    assert sustainable(ladder, 15.0) == 1000
    assert sustainable([row(100, 2.0, errors=1), row(250, 2.0)], 10.0) == 0.0


def test_epoch_rates_are_samples_over_wall_time_per_epoch(tmp_path):
    from pctr_throughput import epoch_rates

    # epoch 0: 10 steps at 0.1 s of 100 samples; epoch 1: 10 steps at 0.05 s; an eval record in between
    records = [
        {"step": 10, "epoch": 0, "samples_per_s": 1000.0, "step_time_s": 0.1},
        {"step": 10, "eval_auc": 0.7},
        {"step": 15, "epoch": 1, "samples_per_s": 2000.0, "step_time_s": 0.05},
        {"step": 20, "epoch": 1, "samples_per_s": 2000.0, "step_time_s": 0.05},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert epoch_rates(tmp_path) == pytest.approx([1000.0, 2000.0])


def test_ps_rate_is_the_second_half_of_each_worker_summed(tmp_path):
    from pctr_throughput import ps_rate

    # worker k: 0.1 s per step of 100 samples for 40 steps, then (epoch 2) 0.05 s per step (k=0) or
    # 0.025 s (k=1); records every 10 steps hold the cumulative samples/s, and one evaluation record
    (tmp_path / "counters").mkdir()
    for k, fast in ((0, 0.05), (1, 0.025)):
        t, recs = 0.0, []
        for step in range(10, 90, 10):
            t += 10 * (0.1 if step <= 40 else fast)
            recs.append({"step": step, "loss": 0.5, "samples_per_s": step * 100 / t})
        recs.append({"step": 80, "val_auc": 0.7, "samples_per_s": 1.0})
        (tmp_path / "counters" / f"worker-{k}.jsonl").write_text("\n".join(map(json.dumps, recs)) + "\n")
    assert ps_rate(tmp_path, 100, 2) == pytest.approx(100 / 0.05 + 100 / 0.025)
    assert ps_rate(tmp_path, 100, 1) == pytest.approx(100 / 0.05)
