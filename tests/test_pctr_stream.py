"""`mariana pctr stream`: files dropped while it runs are consumed once each, a half-written file is never
read, kill -9 mid-file and --resume equals an uninterrupted stream (same weights, same ledger), and a real
`mariana serve --pctr RUN --watch` under a 3-client request stream follows 3 exports without a failed request.
The streams that are watched, signalled or killed are real processes; the refusals and the runs they are
compared with run in this process (`trained_runs.cli_here`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers import DATA, start_cli
from mariana.apps.pctr.models.predict import load_predictor
from mariana.apps.pctr.streams.config import parse_export_every
from mariana.apps.pctr.streams.folder import LogFile, scan
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.export import load_exported
from sklearn.metrics import roc_auc_score
from test_serving_helpers import Server, strip_label
from trained_runs import cli_here

CRITEO = DATA / "criteo" / "criteo_sample.tsv"
LINES = CRITEO.read_text().splitlines(keepends=True)
BASE_NS = 1_700_000_000 * 10**9
# a tiny FM: 300-row files are 2 steps each (256 + 44 rows)
MODEL = ["--format", "criteo", "--preset", "debug", "--model", "fm", "--poll", "0.1"]


def drop(folder: Path, name: str, lines: list[str], order: int | None = None) -> Path:
    """Write ``lines`` under a temporary name, then rename into place (how a log shipper lands a file).
    ``order``: a fixed modification time, so the arrival order is the same in every folder."""
    tmp = folder / f".{name}.tmp"
    tmp.write_text("".join(lines))
    if order is not None:
        os.utime(tmp, ns=(BASE_NS + order * 10**9, BASE_NS + order * 10**9))
    os.replace(tmp, folder / name)
    return folder / name


def chunk(i: int, n: int = 300) -> list[str]:
    return LINES[(i * n) % 900 : (i * n) % 900 + n]


def ledger(run: Path) -> list[dict]:
    latest = (run / "checkpoints" / "latest").read_text().strip()
    state = torch.load(run / "checkpoints" / latest / "state.pt", weights_only=True)
    return state["stream"]["ledger"]


def start(args: list[str], log: Path, env: dict | None = None):
    """``mariana pctr stream ARGS`` in the background (`helpers.start_cli`), its output in ``log`` (emptied)."""
    log.write_text("")
    return start_cli(["pctr", "stream", *args], log, env)


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"streamer exited {proc.returncode} waiting for {what}:\n{log.read_text()[-4000:]}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out waiting for {what}" + (f":\n{log.read_text()[-4000:]}" if log else "")
            )
        time.sleep(0.05)


def consumed(run: Path) -> int:
    try:
        return len(ledger(run))
    except (OSError, RuntimeError, KeyError):
        return 0


def test_scan_rules_and_export_every(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    drop(d, "b.tsv", chunk(0), order=2)
    drop(d, "a.tsv", chunk(1), order=2)  # same time: name breaks the tie
    drop(d, "c.tsv", chunk(2), order=1)
    for name in (".hidden.tsv", "_meta.json", "x.tsv.tmp", "y.part"):
        (d / name).write_text("garbage\n")
    part = d / "hour=01"
    part.mkdir()
    (part / "p1.tsv").write_text("".join(chunk(0)))
    (part / "p0.tsv").write_text("".join(chunk(1)))
    (part / ".p2.tsv.tmp").write_text("garbage\n")
    (d / "hour=02").mkdir()  # no _SUCCESS yet: not complete
    (d / "hour=02" / "p0.tsv").write_text("".join(chunk(0)))
    assert [f.name for f in scan(d)] == ["c.tsv", "a.tsv", "b.tsv"]
    (part / "_SUCCESS").touch()
    os.utime(part / "_SUCCESS", ns=(BASE_NS + 3 * 10**9,) * 2)
    files = scan(d)
    assert [f.name for f in files] == ["c.tsv", "a.tsv", "b.tsv", "hour=01/"]
    assert isinstance(files[-1], LogFile) and [p.name for p in files[-1].paths] == ["p0.tsv", "p1.tsv"]
    assert parse_export_every("3") == ("files", 3.0) and parse_export_every("30s") == ("seconds", 30.0)
    for bad in ("0", "x", "-1", "1.5", "s"):
        with pytest.raises(MarianaError):
            parse_export_every(bad)


def test_cli_refuses_what_a_stream_cannot_do(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    r = cli_here(
        ["pctr", "stream", "--data", d, "--out", tmp_path / "r", "--servers", "1", "--format", "libfm"],
    )
    assert r.returncode == 2 and "--servers >= 1` with --format libfm needs --num-fields" in r.stderr, (
        r.stderr
    )
    f = drop(d, "a.tsv", chunk(0))
    r = cli_here(["pctr", "stream", "--data", f, "--out", tmp_path / "r"])
    assert r.returncode == 2 and "expected a folder to follow" in r.stderr, r.stderr
    r = cli_here(["pctr", "stream", "--data", d, "--out", tmp_path / "r", "--export-every", "2m"])
    assert r.returncode == 2 and "--export-every" in r.stderr, r.stderr


def test_files_dropped_while_running_each_consumed_once(tmp_path):
    """Files land one by one while the streamer runs; a half-written file grows under a temporary name
    meanwhile (and a partition without its _SUCCESS marker waits): neither is read until complete. SIGTERM
    stops it cleanly after checkpointing."""
    d, run, log = tmp_path / "d", tmp_path / "run", tmp_path / "stream.log"
    d.mkdir()
    drop(d, "f0.tsv", chunk(0))
    proc = start(["--data", d, "--out", run, *MODEL, "--export-every", "1"], log)
    try:
        wait_for(lambda: consumed(run) == 1, 120, "the first file", proc, log)
        snap = tmp_path / "after-f0"  # the model exported after f0: progressive AUC on f1 must be its score
        snap.mkdir()
        for name in ("model.safetensors", "model.json"):
            shutil.copy(run / name, snap / name)
        growing = d / ".f9.tsv.part"
        with open(growing, "w") as g:
            g.write("this is not a criteo line\n")  # would be counted as skipped if ever read
            g.flush()
            part = d / "hour=01"
            part.mkdir()
            (part / "p0.tsv").write_text("".join(chunk(1, 100)))
            (part / "p1.tsv").write_text("1\tnot a criteo line\n" + "".join(chunk(2, 10)))  # 1 bad + 10 rows
            for i in (1, 2):
                drop(d, f"f{i}.tsv", chunk(i))
                g.write(LINES[i])  # still growing
                g.flush()
                wait_for(lambda i=i: consumed(run) == i + 1, 60, f"file f{i}.tsv", proc, log)
            assert [e["name"] for e in ledger(run)] == ["f0.tsv", "f1.tsv", "f2.tsv"]
            (part / "_SUCCESS").touch()
            wait_for(lambda: consumed(run) == 4, 60, "the partition", proc, log)
        # the growing file is finished: rewritten whole and renamed into place, it is read once, complete
        os.replace(growing, d / "f9.tsv.part")  # still ignored (.part)
        drop(d, "f9.tsv", chunk(0, 50))
        (d / "f9.tsv.part").unlink()
        wait_for(lambda: consumed(run) == 5, 60, "f9.tsv", proc, log)
        time.sleep(0.5)  # several more scans: nothing is consumed twice
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    led = ledger(run)
    assert [e["name"] for e in led] == ["f0.tsv", "f1.tsv", "f2.tsv", "hour=01/", "f9.tsv"]
    assert [e["rows"] for e in led] == [300, 300, 300, 110, 50]
    assert [e["skipped_lines"] for e in led] == [0, 0, 0, 1, 0]
    assert led[3]["first_skipped"].startswith("p1.tsv: line 1: expected 40 tab-separated fields"), led[3]
    import json

    totals = json.loads((run / "metrics.json").read_text())
    assert totals["files"] == 5 and totals["rows"] == 1060 and totals["skipped_lines"] == 1
    counters = [json.loads(x) for x in (run / "counters" / "worker-0.jsonl").read_text().splitlines()]
    assert [c["file"] for c in counters] == [e["name"] for e in led]
    assert all(c["train_lag_s"] >= 0 for c in counters)
    # progressive AUC = the score of the model BEFORE it trained on the file, computed independently (the
    # serving predictor + scikit-learn); the final model (trained on f1 and more) gives another value
    f1 = chunk(1)
    labels = [int(x.split("\t", 1)[0]) for x in f1]
    before, _ = load_predictor(snap).predict_lines([x.split("\t", 1)[1] for x in f1])
    after, _ = load_predictor(run).predict_lines([x.split("\t", 1)[1] for x in f1])
    assert counters[1]["file"] == "f1.tsv"
    assert abs(counters[1]["progressive_auc"] - roc_auc_score(labels, before)) < 1e-5
    assert abs(roc_auc_score(labels, after) - counters[1]["progressive_auc"]) > 1e-3
    assert "SIGTERM received" in log.read_text()
    assert "skipped 1 malformed line in" in log.read_text()


def test_kill9_mid_file_then_resume_equals_uninterrupted(tmp_path):
    """The streamer SIGKILLs itself in the middle of the third file (MARIANA_FAULT: before global step 6 =
    the second step of file 3); --resume retrains that file from the state before it; that run is killed
    with SIGKILL from outside after at least one more file; a second --resume consumes the rest once.
    Final weights and ledger equal those of a stream that was never interrupted."""
    d, killed, whole = tmp_path / "d", tmp_path / "killed", tmp_path / "whole"
    d.mkdir()
    for i in range(4):
        drop(d, f"f{i}.tsv", chunk(i), order=i)
    args = [
        "--data",
        d,
        *MODEL,
        "--export-every",
        "2",
        "--max-files",
        "6",
        "--dropout",
        "0.1",
        "--model",
        "dnn",
    ]
    log = tmp_path / "killed.log"
    proc = start([*args, "--out", killed], log, env={"MARIANA_FAULT": "kill:rank=0:step=6"})
    assert proc.wait(120) == -signal.SIGKILL, log.read_text()
    assert [e["name"] for e in ledger(killed)] == ["f0.tsv", "f1.tsv"]  # f2 was interrupted mid-file
    for i in (4, 5):
        drop(d, f"f{i}.tsv", chunk(i), order=i)
    # a second kill, from outside this time, wherever the resumed stream is after its third file
    log2 = tmp_path / "killed2.log"
    proc = start([*args, "--out", killed, "--resume"], log2)
    try:
        wait_for(lambda: consumed(killed) >= 3, 120, "the resumed stream's first file", proc, log2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert "resumed from step_00000002: 2 files consumed" in log2.read_text(), log2.read_text()
    r = cli_here(["pctr", "stream", *args, "--out", killed, "--resume"], check=True)
    assert "resumed from step_0000000" in r.stderr, r.stderr
    cli_here(["pctr", "stream", *args, "--out", whole], check=True)
    a, b = ledger(killed), ledger(whole)
    names = [e["name"] for e in a]
    assert names == [f"f{i}.tsv" for i in range(6)] and len(set(names)) == 6
    assert names == [e["name"] for e in b]
    assert [(e["rows"], e["steps"], e["auc"]) for e in a] == [(e["rows"], e["steps"], e["auc"]) for e in b]
    sa, ma = load_exported(killed)
    sb, mb = load_exported(whole)
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert ma["version"] == mb["version"]


def test_serving_follows_three_exports_without_failed_requests(tmp_path, tmp_path_factory):
    """A real `mariana serve --pctr RUN --watch --watch-interval 0.2` answers 3 clients continuously while
    the running streamer trains on 3 more files and exports after each: no request fails and the version
    in the answers changes 3 times, in export order."""
    d, run, log = tmp_path / "d", tmp_path / "run", tmp_path / "stream.log"
    d.mkdir()
    drop(d, "f0.tsv", chunk(0))
    proc = start(["--data", d, "--out", run, *MODEL, "--export-every", "1"], log)
    srv = None
    results, stop = [], threading.Event()
    lines = [strip_label(ln, "criteo") for ln in LINES[900:908]]
    try:
        wait_for(
            lambda: (run / "model.json").is_file() and consumed(run) == 1, 120, "the first export", proc, log
        )
        srv = Server(["--pctr", run, "--watch", "--watch-interval", "0.2", "--threads", "1"], tmp_path)

        def client(k: int):
            with httpx.Client(base_url=srv.url, timeout=30) as c:
                i = 0
                while not stop.is_set():
                    n = 1 + (i + k) % len(lines)
                    try:
                        r = c.post("/v1/pctr/predict", json={"instances": lines[:n]})
                        body = r.json()
                        ok = r.status_code == 200 and len(body["probabilities"]) == n and not body["errors"]
                        results.append((k, ok, body.get("model_version")))
                    except Exception as e:  # noqa: BLE001  -- a dropped connection is a failure too
                        results.append((k, False, type(e).__name__))
                    i += 1
                    time.sleep(0.005)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        versions = [ledger(run)[-1]["version"]]
        for i in (1, 2, 3):
            time.sleep(0.3)
            drop(d, f"f{i}.tsv", chunk(i))
            wait_for(lambda i=i: consumed(run) == i + 1, 60, f"file {i}", proc, log)
            versions.append(ledger(run)[-1]["version"])
            wait_for(
                lambda: srv.client.get("/healthz").json()["models"]["pctr"]["version"] == versions[-1],
                30,
                f"the server to load version {versions[-1]}",
            )
        time.sleep(0.3)
    finally:
        stop.set()
        for t in threads if srv else []:
            t.join(30)
        if srv is not None:
            srv.stop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    assert len(set(versions)) == 4, versions
    failed = [r for r in results if not r[1]]
    assert not failed and len(results) > 30, (failed[:5], len(results))
    # every answer names one of the exports; each client sees them in export order, never going back
    assert {v for _, _, v in results} == set(versions)
    for k in range(3):
        order = [versions.index(v) for c, _, v in results if c == k]
        assert order == sorted(order), (k, order)


def test_libfm_fields_from_first_file_and_resume(tmp_path):
    """libFM without --num-fields: the width comes from the first file and is kept for --resume; a
    malformed line is skipped and counted, not a crash. A stream stopped after a file's checkpoint, before
    (or while) writing its counters record, writes that record when it resumes: one record per file."""
    frappe = (DATA / "frappe" / "frappe.validation.libfm").read_text().splitlines(keepends=True)
    d, run = tmp_path / "d", tmp_path / "run"
    d.mkdir()
    drop(d, "a.libfm", frappe[:300], order=0)
    drop(d, "b.libfm", [*frappe[300:500], "1 not:a:feature oops\n"], order=1)
    args = [
        "pctr",
        "stream",
        "--data",
        d,
        "--out",
        run,
        "--format",
        "libfm",
        "--preset",
        "debug",
        "--poll",
        "0.1",
    ]
    cli_here([*args, "--max-files", "1"], check=True)
    counters = run / "counters" / "worker-0.jsonl"
    first = json.loads(counters.read_text())
    # the stop: a.libfm checkpointed, its counters record half written
    counters.write_text('{"time": 1, "file": "a.lib')
    r = cli_here([*args, "--max-files", "2", "--resume"], check=True)
    assert "resumed from step_00000001: 1 files consumed" in r.stderr, r.stderr
    recs = [json.loads(x) for x in counters.read_text().splitlines()]
    assert [(x["file"], x.get("recovered", False)) for x in recs] == [("a.libfm", True), ("b.libfm", False)]
    assert {k: recs[0][k] for k in ("files", "rows", "progressive_auc", "train_s")} == {
        k: first[k] for k in ("files", "rows", "progressive_auc", "train_s")
    }
    led = ledger(run)
    assert [(e["name"], e["rows"], e["skipped_lines"]) for e in led] == [
        ("a.libfm", 300, 0),
        ("b.libfm", 200, 1),
    ]
    assert "line 201" in led[1]["first_skipped"]


def test_export_every_seconds(tmp_path):
    """--export-every 3600s: no export until the time is up; then one export of the changed model, none
    while nothing changed, and a stopping stream with nothing new exports nothing more."""
    import dataclasses

    from mariana.apps.pctr.streams.config import STREAM_PRESETS
    from mariana.apps.pctr.streams.streamer import Streamer

    d, run = tmp_path / "d", tmp_path / "run"
    d.mkdir()
    for i in range(2):
        drop(d, f"f{i}.tsv", chunk(i), order=i)
    cfg = dataclasses.replace(
        STREAM_PRESETS["debug"], data=str(d), out=str(run), format="criteo", model="fm", export_every="3600s"
    )
    cfg.idle_exit, cfg.poll = 0.2, 0.05
    cfg.validate()
    s = Streamer(cfg)
    for f in s.pending():
        s.consume(f)
    assert not (run / "model.json").exists() and s.dirty and s.totals["files"] == 2
    s.last_export -= 3600
    assert s.maybe_export() and (run / "model.json").is_file() and not s.dirty
    assert not s.maybe_export()
    assert s.run_forever()["exports"] == 1
    assert [e["version"] for e in s.ledger] == [s.version, s.version]
