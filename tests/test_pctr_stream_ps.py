"""`mariana pctr stream --servers S --workers W` as real torchrun jobs (servers and workers talking over
TensorPipe RPC on loopback): files dropped while it runs are consumed once by all workers, the
bulk-synchronous stream equals the one-process stream, and a run continued with --resume whose worker is
killed mid-file (torchrun restarts the group) ends with the model and ledger of an uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import run_cli
from mariana.apps.pctr.models.predict import load_predictor
from mariana.platform.core.export import load_exported
from sklearn.metrics import roc_auc_score
from test_pctr_stream import LINES, MODEL, chunk, drop, start, wait_for
from trained_runs import cli_here

pytestmark = pytest.mark.slow


def ledger(run: Path) -> list[dict]:
    latest = (run / "checkpoints" / "latest").read_text().strip()
    return json.loads((run / "checkpoints" / latest / "stream.json").read_text())["ledger"]


def consumed(run: Path) -> int:
    try:
        return len(ledger(run))
    except (OSError, ValueError, KeyError):
        return 0


def counters(run: Path, worker: int) -> list[dict]:
    return [json.loads(x) for x in (run / "counters" / f"worker-{worker}.jsonl").read_text().splitlines()]


def test_two_workers_consume_each_dropped_file_once(tmp_path):
    """S=1, W=2, asynchronous: files land while the job runs (a half-written file grows under a temporary
    name meanwhile); SIGTERM right after the third lands stops the whole job at once (wherever it is in
    that file); --resume then consumes the rest. Each file is in the ledger once with its rows, trained on
    by both workers; one version is exported per file."""
    d, run, log = tmp_path / "d", tmp_path / "run", tmp_path / "stream.log"
    d.mkdir()
    drop(d, "f0.tsv", chunk(0))
    args = ["--data", d, "--out", run, *MODEL, "--servers", "1", "--workers", "2", "--no-progress"]
    proc = start(args, log)
    try:
        wait_for(lambda: consumed(run) == 1, 120, "the first file", proc, log)
        snap = tmp_path / "after-f0"  # exported after f0 (before its checkpoint): the model that scores f1
        snap.mkdir()
        for name in ("model.safetensors", "model.json"):
            shutil.copy(run / name, snap / name)
        with open(d / ".f9.tsv.part", "w") as g:
            g.write("this is not a criteo line\n")  # would be counted as skipped if ever read
            g.flush()
            drop(d, "f1.tsv", chunk(1))
            g.write(LINES[1])
            g.flush()
            wait_for(lambda: consumed(run) == 2, 60, "file f1.tsv", proc, log)
        drop(d, "f2.tsv", chunk(2, 600))
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 130, log.read_text()  # `mariana: interrupted`
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    before = consumed(run)  # 2, or 3 if f2 was finished before the signal
    assert before in (2, 3)
    drop(d, "f3.tsv", chunk(3))
    r = run_cli(["pctr", "stream", *args, "--resume", "--max-files", "4"], timeout=180, check=True)
    t_end = time.time()
    assert "stream: 4 files, 1500 rows, 4 exports" in r.stdout, r.stdout
    led = ledger(run)
    names = ["f0.tsv", "f1.tsv", "f2.tsv", "f3.tsv"]
    assert [(e["name"], e["rows"], e["skipped_lines"]) for e in led] == list(
        zip(names, [300, 300, 600, 300], [0] * 4)
    )
    # B = 256, W = 2: one step of both workers per 300-row file, two for the 600-row file
    assert [e["steps"] for e in led] == [1, 1, 2, 1]
    totals = json.loads((run / "metrics.json").read_text())
    assert (totals["files"], totals["rows"], totals["steps"], totals["skipped_lines"]) == (4, 1500, 5, 0)
    assert totals["mode"] == "stream, parameter-server" and totals["workers"] == 2
    recs = [r for r in counters(run, 0) if "file" in r]
    assert [r["file"] for r in recs] == names  # no file recorded twice
    for rec in recs:  # lag: from landing (the file's mtime or later) to trained, so at least its training
        assert rec["train_s"] <= rec["train_lag_s"] <= t_end - (d / rec["file"]).stat().st_mtime, rec
    # progressive AUC = the score of the whole model BEFORE the file (all workers' parts of the files
    # before it applied), computed independently: scikit-learn's AUC of the model exported after f0,
    # scored through the serving predictor; the final model (trained on f1 and more) gives another value
    f1 = chunk(1)
    labels = [int(x.split("\t", 1)[0]) for x in f1]
    p_before, _ = load_predictor(snap).predict_lines([x.split("\t", 1)[1] for x in f1])
    p_after, _ = load_predictor(run).predict_lines([x.split("\t", 1)[1] for x in f1])
    assert abs(recs[1]["progressive_auc"] - roc_auc_score(labels, p_before)) < 1e-5, recs[1]
    assert abs(roc_auc_score(labels, p_after) - recs[1]["progressive_auc"]) > 1e-3
    assert len({r["version"] for r in recs}) == 4  # --export-every 1: one version per file
    assert json.loads((run / "model.json").read_text())["version"] == recs[-1]["version"]
    # both workers trained on every file the resumed job consumed: 2 pushes per step
    server = json.loads((run / "counters" / "server-0.json").read_text())
    assert server["pushes"] == 2 * sum(e["steps"] for e in led[before:]), (server, before)
    assert (
        f"resumed from step_0000000{ {2: 2, 3: 4}[before] }: {before} files consumed"
        in (run / "logs" / "rank-1.log").read_text()
    )


# Four 300-row files in a fixed arrival order, and the one-process stream over them with batch 512:
# the bulk-synchronous PS streams below must end with its weights (W = 1, batch 512: the same steps; W = 2,
# batch 256 each: one step averages both workers' halves of the same 512-row slice). Without --l2-emb: it
# regularises the rows each worker's half looks up, so a row only one worker saw would get half the L2.
FOUR = ["--export-every", "2", "--l2-emb", "0", "--max-files", "4", "--no-progress"]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-ps")
    d, one = root / "d", root / "one"
    d.mkdir()
    for i in range(4):
        drop(d, f"f{i}.tsv", chunk(i), order=i)
    cli_here(["pctr", "stream", "--data", d, *MODEL, *FOUR, "--out", one, "--batch-size", "512"], check=True)
    return d, one


def _one_ledger(run: Path) -> list[dict]:
    latest = (run / "checkpoints" / "latest").read_text().strip()
    return torch.load(run / "checkpoints" / latest / "state.pt", weights_only=True)["stream"]["ledger"]


def assert_same_model(run: Path, one: Path) -> None:
    """The exported weights equal the one-process stream's (float rounding of a server's optimiser);
    the ledgers name the same files, rows and progressive AUCs."""
    got, want = load_exported(run)[0], load_exported(one)[0]
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=k)
    assert int(want["seen"].sum()) > 1000  # rows trained on (and the same ones in both)
    a, b = ledger(run), _one_ledger(one)
    assert [(e["name"], e["rows"]) for e in a] == [(e["name"], e["rows"]) for e in b]
    assert [e["auc"] for e in a] == pytest.approx([e["auc"] for e in b], abs=1e-5)


def test_bulk_synchronous_one_worker_equals_one_process_stream(four, tmp_path):
    """--staleness 0 with W = 1: the same steps on the same rows with the same optimisers as the
    one-process stream."""
    d, one = four
    ps = ["--servers", "1", "--workers", "1", "--staleness", "0", "--batch-size", "512"]
    r = run_cli(
        ["pctr", "stream", "--data", d, *MODEL, *FOUR, *ps, "--out", tmp_path / "ps"], timeout=180, check=True
    )
    assert "stream: 4 files, 1200 rows, 2 exports" in r.stdout, r.stdout
    assert [e["steps"] for e in ledger(tmp_path / "ps")] == [1, 1, 1, 1]
    assert_same_model(tmp_path / "ps", one)


def test_resume_then_killed_worker_equals_synchronous_sgd(four, tmp_path):
    """S=1, W=2, --staleness 0. Run 1 stops after 2 files (--max-files); run 2 continues with --resume,
    and its worker 1 is SIGKILLed at the start of the third file (MARIANA_FAULT: before global step 3;
    one step per 300-row file): torchrun restarts the group, the servers restore the checkpoint after file
    2 and the third file is trained on again from that state. Each file is in the ledger once and the
    weights equal the one-process stream's (a lost or repeated step would move them far more)."""
    d, one = four
    killed = tmp_path / "killed"
    args = [
        "pctr",
        "stream",
        "--data",
        d,
        *MODEL,
        *FOUR,
        "--servers",
        "1",
        "--workers",
        "2",
        "--staleness",
        "0",
    ]
    run_cli([*args, "--out", killed, "--max-files", "2"], timeout=180, check=True)
    assert [e["name"] for e in ledger(killed)] == ["f0.tsv", "f1.tsv"]
    r = run_cli(
        [*args, "--out", killed, "--resume"], timeout=180, env={"MARIANA_FAULT": "kill:worker=1:step=3"}
    )
    assert r.returncode == 0, r.stderr[-4000:]
    c = json.loads((killed / "counters.json").read_text())
    assert c["restarts"] == 1 and c["servers"]["server-0"]["restored_from"] == 2, c
    log = (killed / "logs" / "rank-1.log").read_text()
    assert log.count("resumed from step_00000002: 2 files consumed") == 2, log[-3000:]  # both attempts
    led = ledger(killed)
    assert [(e["name"], e["steps"]) for e in led] == [(f"f{i}.tsv", 1) for i in range(4)]
    assert json.loads((killed / "metrics.json").read_text())["steps"] == 4
    assert_same_model(killed, one)
