"""``kill -9`` of the job service while jobs run loses nothing: jobs are re-adopted or finalised on restart."""

from __future__ import annotations

import sqlite3
import threading

import pytest
from helpers import DATA, ROOT, cli_env
from jobs_helpers import Service, wait_for
from mariana.platform.jobs.executor import LocalExecutor
from mariana.platform.runtime.launch import process_alive

FRAPPE = DATA / "frappe" / "frappe.validation.libfm"
pytestmark = pytest.mark.slow


def test_kill9_restart_readopts_and_finalises(tmp_path):
    home = tmp_path / "home"
    small = tmp_path / "small.libfm"
    with open(FRAPPE) as f:
        small.write_text("".join(line for _, line in zip(range(2000), f)))
    svc = Service(home, slots=2)
    try:

        def post(argv, **kw):
            r = svc.http.post("/api/jobs", json={"argv": argv, **kw})
            assert r.status_code == 201, r.text
            return r.json()["id"]

        long = post(["mlp", "train", "--data", str(FRAPPE), "--epochs", "50", "--batch-size", "64",
                     "--log-every", "20", "--no-progress"])  # fmt: skip

        def long_metrics():
            n = len(svc.http.get(f"/api/jobs/{long}/metrics").json()["records"])
            return svc.job(long)["state"] == "running" and n >= 2 and n

        # The short job (a few seconds) starts only once the long one has metrics in the database: submitted
        # together, the short one could end before the long one logged anything under a loaded machine.
        wait_for(long_metrics, 180, "the long job running with metrics in the database")
        short = post(["mlp", "train", "--data", str(small), "--max-steps", "30", "--batch-size", "32",
                      "--log-every", "5", "--no-progress"])  # fmt: skip
        # Needs both slots, so it waits behind the long job (and must still be waiting after the restart).
        queued = post(
            ["mlp", "train", "--data", str(small), "--workers", "2", "--max-steps", "2"], priority=5
        )
        wait_for(
            lambda: svc.job(short)["state"] == "running" and svc.job(short)["pid"],
            180,
            "the short job running",
        )
        before = long_metrics()  # the long job's records just before the kill
        a = svc.job(long)
        svc.kill9()

        # While the service is down: the jobs keep running (own sessions); the short one ends.
        run_short = home / "runs" / f"job-{short}"
        wait_for(
            lambda: (run_short / "job.exit").is_file(), 180, "the short job ends while the service is down"
        )
        assert (run_short / "job.exit").read_text().strip() == "0"
        assert process_alive(a["pid"], None)
        db = sqlite3.connect(home / "jobs.db")
        states = dict(db.execute("select id, state from jobs").fetchall())
        assert states == {long: "running", short: "running", queued: "queued"}
        assert db.execute("pragma journal_mode").fetchone()[0] == "wal"
        db.close()
    finally:
        svc.proc.kill()

    svc = Service(home, slots=2)
    try:
        b = svc.job(short)  # finished while the service was down: finalised from job.exit and its files
        assert b["state"] == "succeeded" and b["exit_code"] == 0
        assert b["final_metrics"]["steps"] == 30 and b["export"] and b["last_step"] == 30
        assert b["ended"] <= (run_short / "job.exit").stat().st_mtime + 1e-3
        steps = [
            r["step"] for r in svc.http.get(f"/api/jobs/{short}/metrics").json()["records"] if "loss" in r
        ]
        assert steps == [5, 10, 15, 20, 25, 30]  # every record, once
        a2 = svc.job(long)  # still alive: re-adopted, same process
        assert a2["state"] == "running" and a2["pid"] == a["pid"]
        assert svc.job(queued)["state"] == "queued"
        events = [e["message"] for e in svc.http.get(f"/api/jobs/{long}/events").json()["events"]]
        assert any("re-adopted" in m for m in events)

        def more():  # the counters continue: records written after the restart reach the database
            recs = svc.http.get(f"/api/jobs/{long}/metrics").json()["records"]
            return len(recs) > before + 1 and recs

        recs = wait_for(more, 120, "more metrics records after the restart")
        seqs = [r["seq"] for r in recs]
        assert seqs == list(range(1, len(recs) + 1))  # no gap, no duplicate across the restart
        svc.http.post(f"/api/jobs/{queued}/cancel").raise_for_status()
        svc.http.post(f"/api/jobs/{long}/cancel").raise_for_status()
        wait_for(lambda: svc.job(long)["state"] == "cancelled", 60, "the re-adopted job cancelled")
        assert not process_alive(a["pid"], None)
        for job_id, expected in ((long, "cancelled"), (short, "succeeded"), (queued, "cancelled")):
            states = [e["state"] for e in svc.http.get(f"/api/jobs/{job_id}/events").json()["events"]]
            order = ["queued", "running", "cancelling", expected]
            assert [order.index(s) for s in states] == sorted(order.index(s) for s in states), states
            assert states[-1] == expected
    finally:
        svc.stop()


def test_logstore_tails_metrics_and_counters_incrementally(tmp_path):
    """The LogStore on a real SQLite file: only complete lines, each once, corrupt lines counted, the
    parameter-server counters (worker JSONL, server JSON, final counters.json) and the best metric."""
    import json
    import time

    from mariana.platform.jobs.db import CounterRecord, Database, Job, MetricRecord
    from mariana.platform.jobs.logstore import LogStore

    db = Database(f"sqlite:///{tmp_path / 'jobs.db'}")
    run = tmp_path / "run"
    (run / "counters").mkdir(parents=True)
    with db.write() as s:
        job = Job(app="pctr", command="train", argv=["pctr", "train"], state="running", created=time.time(),
                  started=time.time(), run_dir=str(run))  # fmt: skip
        s.add(job)
    store = LogStore(db)
    w0 = run / "counters" / "worker-0.jsonl"
    w0.write_text(json.dumps({"step": 10, "loss": 0.6, "val_auc": 0.71}) + "\n" + '{"step": 20, "lo')
    (run / "metrics.jsonl").write_text("not json\n" + json.dumps({"step": 5, "eval_logloss": 0.5}) + "\n")
    assert store.ingest(job.id) == 2
    assert store.ingest(job.id) == 0  # nothing new: nothing stored twice
    with open(w0, "a") as f:  # the writer finishes its line, then writes more
        f.write(
            'ss": 0.5, "val_auc": 0.69}\n' + json.dumps({"step": 30, "loss": 0.4, "val_auc": 0.75}) + "\n"
        )
    (run / "counters" / "server-0.json").write_text(json.dumps({"pulls": 7, "pushes": 3}))
    assert store.ingest(job.id) == 2
    (run / "counters.json").write_text(json.dumps({"restarts": 0, "wall_s": 1.5}))
    store.finalize(job.id)
    with db.read() as s:
        j = s.get(Job, job.id)
        history = [(r.seq, r.data["step"]) for r in s.query(CounterRecord).order_by(CounterRecord.seq)]
        metrics = [r.data for r in s.query(MetricRecord)]
    assert history == [(1, 10), (2, 20), (3, 30)]
    assert metrics == [{"step": 5, "eval_logloss": 0.5}]
    assert j.best_metric == {"name": "val_auc", "value": 0.75, "step": 30}  # auc outranks logloss
    assert j.counters["workers"]["worker-0"]["records"] == 3 and j.counters["corrupt_lines"] == 1
    assert j.counters["servers"]["server-0"] == {"pulls": 7, "pushes": 3}
    assert j.counters["final"] == {"restarts": 0, "wall_s": 1.5} and j.last_step == 5


def test_an_ending_job_wakes_the_scheduler_and_keeps_its_exit_status(tmp_path):
    """The LocalExecutor calls ``on_exit`` (the scheduler's wake) as soon as a job's runner ends, without
    taking its status: `poll` still reads it (0 for a `--help` that prints its usage, 2 for a bad flag), as
    does the job's exit file."""
    for argv, code in ((["mlp", "eval", "--help"], 0), (["mlp", "eval", "--bogus"], 2)):
        ended = threading.Event()
        executor = LocalExecutor()
        executor.on_exit = ended.set
        run = tmp_path / f"run-{code}"
        handle = executor.start(1, argv, run, str(ROOT), cli_env())
        assert ended.wait(60), (run / "job.log").read_text()
        assert executor.poll(handle, run) == code == int((run / "job.exit").read_text())
        assert "usage: mariana mlp eval" in (run / "job.log").read_text()
