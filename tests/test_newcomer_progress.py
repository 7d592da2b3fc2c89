"""Issue 41 point 10: long commands show progress. Off a terminal (a log, the job service, these tests)
the one helper, `console.progress`, prints ``mariana: DESC: K/N UNITS (P %)`` lines (every
``$MARIANA_PROGRESS_EVERY`` seconds; 0 here: every unit) and the launcher's thread (`launch.watch`) relays
a parameter-server job's workers. Checked on the commands the issue names: ``vision eval --tta-mode crops`` (with the new
``--limit``), the feature computation of ``asr train``'s cache, ``pctr train --servers``' master."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from cliwalk import run_main
from PIL import Image

FSDD = "../shared/data/fsdd/recordings"


@pytest.fixture
def every_unit(monkeypatch):
    monkeypatch.setenv("MARIANA_PROGRESS_EVERY", "0")


def test_progress_prints_lines_off_a_terminal(every_unit, capsys):
    from mariana.platform.cli.console import progress

    assert list(progress(range(3), 3, "work", "steps")) == [0, 1, 2]
    assert capsys.readouterr().err.splitlines()[:3] == [
        "mariana: work: 1/3 steps (33 %)", "mariana: work: 2/3 steps (66 %)", "mariana: work: 3/3 steps (100 %)"
    ]  # fmt: skip


def test_vision_eval_with_crops_shows_progress_and_takes_a_limit(every_unit, tmp_path, capsys, monkeypatch):
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        for i in range(5):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(
                tmp_path / "imgs" / c / f"{i}.jpg"
            )
    run = tmp_path / "run"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    rc, out, err = run_main(["vision", "train", "--data", tmp_path / "imgs", "--out", run, "--preset", "debug",
                             "--limit", "0", "--max-steps", "1", "--batch-size", "4", "--no-progress"], capsys)  # fmt: skip
    assert rc == 0, err
    argv = [
        "vision",
        "eval",
        "--model",
        run,
        "--data",
        tmp_path / "imgs",
        "--tta-mode",
        "crops",
        "--device",
        "cpu",
    ]
    rc, out, err = run_main([*argv, "--batch-size", "2", "--limit", "6"], capsys)
    assert rc == 0 and "images 6;" in out, out + err
    assert "mariana: eval imgs: 1/3 batches (33 %)" in err and "3/3 batches (100 %)" in err, err
    rc, _, err = run_main([*argv, "--limit", "-1"], capsys)
    assert rc == 2 and "--limit must be >= 0 images" in err, err


def test_asr_feature_computation_shows_progress(every_unit, capsys):
    from pathlib import Path

    from mariana.apps.asr.configs import AsrConfig
    from mariana.apps.asr.features import compute_raw, feature_settings

    wavs = sorted(Path(FSDD).glob("*_george_*.wav"))[:130]
    feats, failed = compute_raw([(str(w), 1.0, 1.0, 1.0) for w in wavs], feature_settings(AsrConfig()), 2)
    assert len(feats) == 130 and not failed
    err = capsys.readouterr().err
    assert "mariana: computing features: 3/3 chunks of 64 recordings (100 %)" in err, err


def test_a_parameter_server_master_relays_its_workers_progress(monkeypatch, tmp_path, capsys):
    """`pctr train --servers`' master prints its workers' last counters records while the job runs."""
    import threading

    from mariana.apps.pctr.commands import workers_progress
    from mariana.platform.runtime.launch import watch

    monkeypatch.setenv("MARIANA_PROGRESS_EVERY", "0.05")
    (tmp_path / "counters").mkdir()
    assert workers_progress(tmp_path) == ""
    for w, step in ((0, 20), (1, 18)):
        rec = {"step": step, "loss": 0.5 - w / 10}
        (tmp_path / "counters" / f"worker-{w}.jsonl").write_text(json.dumps(rec) + "\n" + '{"step": 4')
    done = threading.Event()  # the launcher's thread while the job runs
    relay = threading.Thread(target=watch, args=(tmp_path, {}, done, lambda: workers_progress(tmp_path)))
    relay.start()
    time.sleep(0.6)
    done.set()
    relay.join()
    lines = capsys.readouterr().err.splitlines()
    assert lines and set(lines) == {
        "mariana: pctr train: worker 0 step 20 loss 0.5000, worker 1 step 18 loss 0.4000"
    }
    # a worker's last record is its validation (no loss): the step alone, no KeyError in the relay's thread
    (tmp_path / "counters" / "worker-1.jsonl").write_text(json.dumps({"step": 30, "val_auc": 0.9}) + "\n")
    assert workers_progress(tmp_path) == "pctr train: worker 0 step 20 loss 0.5000, worker 1 step 30"
