"""ASR accuracy gate, end to end through the CLI with real torchrun workers: prepare (4 FSDD speakers
train, the fifth held out) -> train preset `small` with 2 data-parallel workers -> eval on the held-out
speaker (WER <= 20%; each file normalised alone, as `transcribe` does: <= 25%).

Minutes of training: marked ``accuracy`` (not in `make test-fast`). The eval options and one-file paths
this test once also walked on its trained run (--tempo, transcribe, the Python API, the server) need no
accurate model and run on a tiny one in tests/test_asr_tempo_transcriber.py. The first eval is a process
of its own; the second goes through the CLI's entry point in this process (a torch start-up and a model
load saved; the CLI's own process behaviour is tested by the first eval and by test_asr_transcribe.py)."""

from __future__ import annotations

import json
import re
import time

import pytest
from cliwalk import run_main
from helpers import last_line, run_cli
from mariana.platform.core.rundir import eval_result_path

pytestmark = [pytest.mark.slow, pytest.mark.accuracy]

HELD_OUT = "jackson"


def test_small_preset_heldout_speaker_wer(data_dir, tmp_path, capsys):
    out, run = tmp_path / "data", tmp_path / "run"
    t0 = time.perf_counter()
    run_cli(
        ["asr", "prepare", "--data", data_dir / "fsdd/recordings", "--out", out, "--test-speakers", HELD_OUT,
         "--utterances", "150", "--max-digits", "5", "--seed", "0"],
        timeout=300,
        check=True,
    )  # fmt: skip
    t1 = time.perf_counter()
    r = run_cli(
        ["asr", "train", "--data", out, "--out", run, "--preset", "small", "--workers", "2",
         "--batch-size", "8", "--no-progress"],
        timeout=1800,  # a hang guard: the other xdist worker shares the 2 cores (380 s seen; 914 s on 2026-12-05)
        check=True,
    )  # fmt: skip
    t2 = time.perf_counter()
    assert "launching 2 worker(s)" in r.stderr
    assert re.fullmatch(r"train loss \d+\.\d{4}", last_line(r.stdout)), r.stdout
    final = json.loads((run / "metrics.json").read_text())
    assert final["world_size"] == 2
    e = run_cli(["asr", "eval", "--model", run, "--data", out / "test"], timeout=300, check=True)
    t3 = time.perf_counter()
    m = re.fullmatch(r"WER (\d+\.\d\d)% SER (\d+\.\d\d)%", last_line(e.stdout))
    assert m, e.stdout
    result_path = eval_result_path(run, out / "test")
    assert str(result_path) in e.stdout
    result = json.loads(result_path.read_text())
    assert result["utterances"] == 150 and abs(result["wer"] - float(m.group(1))) < 0.01

    # One file at a time (transcribe, the server) has no speaker statistics: `eval --cmvn file` normalises
    # each file alone with the training speakers' prior (what `transcribe` does; that the two agree is
    # tested in test_asr_transcribe.py and test_asr_tempo_transcriber.py).
    rc, stdout, err = run_main(
        ["asr", "eval", "--model", run, "--data", out / "test", "--cmvn", "file"], capsys
    )
    assert rc == 0, err[-4000:]
    t4 = time.perf_counter()
    per_file = json.loads(result_path.read_text())
    print(
        f"prepare {t1 - t0:.0f}s train {t2 - t1:.0f}s eval {t3 - t2:.0f}s eval --cmvn file {t4 - t3:.0f}s: "
        f"{last_line(e.stdout)}; --cmvn file: WER {per_file['wer']:.2f}%"
    )
    assert result["wer"] <= 20.0, f"held-out speaker {HELD_OUT}: {last_line(e.stdout)}"
    assert per_file["cmvn"] == "file" and per_file["wer"] <= 25.0, last_line(stdout)
