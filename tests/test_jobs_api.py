"""The job service end to end: a real ``mariana jobs serve`` process, the real CLI client, real jobs.

The client commands run in this process (`jobs_helpers.run_in_process`) except a few kept as real
processes for their exit codes: each client process would cost an interpreter start-up, and
the service and its jobs, which these tests are about, are real processes either way."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest
from helpers import DATA, assert_cli_error, last_line, run_cli
from jobs_helpers import Service, run_in_process, wait_for
from mariana.platform.jobs.executor import descendants, proc_stat, process_alive

FRAPPE = DATA / "frappe" / "frappe.validation.libfm"
pytestmark = pytest.mark.slow


@pytest.fixture
def service(tmp_path):
    svc = Service(tmp_path / "home", slots=2)
    yield svc
    svc.stop()


@pytest.fixture
def run_in(capsys):
    """``run_in(argv, env=None, check=False)``: `run_in_process` (``mariana ARGV`` in this process)."""
    return lambda argv, env=None, check=False: run_in_process(argv, capsys, env, check)


def submit(svc: Service, *argv: str) -> int:
    """``mariana submit`` as a real process; the job's id."""
    proc = run_cli(["submit", "--url", svc.url, *argv], timeout=120, check=True)
    return int(last_line(proc.stdout))


def test_round_trip_submit_list_show_logs_wait_cancel_retry(service, run_in):
    svc = service
    quick = submit(svc, "--name", "quick", "mlp", "train", "--data", FRAPPE, "--max-steps", "20",
                   "--batch-size", "64", "--log-every", "5", "--eval-every", "10", "--no-progress")  # fmt: skip
    long = run_in(["submit", "--url", svc.url, "--priority", "1", "mlp", "train", "--data", FRAPPE, "--epochs",
                   "50", "--batch-size", "64", "--ckpt-every", "20", "--no-progress"], check=True)  # fmt: skip
    long = int(last_line(long.stdout))
    assert long == quick + 1

    proc = run_cli(["jobs", "wait", quick, "--timeout", "240"], env=svc.env())  # a real client process
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"job {quick} succeeded, best eval_auc" in proc.stdout

    job = json.loads(run_in(["jobs", "show", quick, "--json"], svc.env(), check=True).stdout)
    assert job["state"] == "succeeded" and job["exit_code"] == 0 and job["name"] == "quick"
    assert job["argv"][-2:] == ["--out", str(svc.home.resolve() / "runs" / f"job-{quick}")]
    assert job["last_step"] == 20 and job["best_metric"]["name"] == "eval_auc"
    assert 0 < job["best_metric"]["value"] <= 1
    assert job["final_metrics"]["steps"] == 20 and job["export"].endswith("model.safetensors")
    assert job["config"]["max_steps"] == 20 and job["started"] <= job["ended"]

    records = svc.http.get(f"/api/jobs/{quick}/metrics").json()
    steps = [r["step"] for r in records["records"] if "loss" in r]
    assert steps == [5, 10, 15, 20] and records["next"] == records["records"][-1]["seq"]
    later = svc.http.get(f"/api/jobs/{quick}/metrics", params={"after": records["next"] - 1}).json()
    assert [r["seq"] for r in later["records"]] == [records["next"]]
    r = svc.http.post(f"/api/jobs/{quick}/serve")  # `mariana serve` serves pctr/asr/vision, not the MLP
    assert r.status_code == 400 and "cannot be served" in r.json()["detail"]
    model = svc.http.get(f"/api/jobs/{quick}/files/model.safetensors")
    assert model.status_code == 200 and len(model.content) == Path(job["export"]).stat().st_size

    logs = run_in(["jobs", "logs", quick], svc.env(), check=True).stdout
    assert "validation AUC" in last_line(logs)
    listing = json.loads(run_in(["jobs", "list", "--json"], svc.env(), check=True).stdout)["jobs"]
    assert [j["id"] for j in listing] == [long, quick]  # newest first
    table = run_in(["jobs", "list"], svc.env(), check=True).stdout
    assert "succeeded" in table and "eval_auc" in table

    # Cancel a long job: its whole process group (and every descendant) must be gone.
    ckpt = svc.home.resolve() / "runs" / f"job-{long}" / "checkpoints" / "latest"
    wait_for(lambda: ckpt.is_file(), 180, "the long job's first checkpoint")
    job = svc.job(long)
    pid = job["pid"]
    tree = [(pid, proc_stat(pid)[2]), *descendants(pid)]
    assert len(tree) >= 2  # the runner and the mariana command under it
    assert run_in(["jobs", "cancel", long], svc.env(), check=True).returncode == 0
    proc = run_in(["jobs", "wait", long, "--timeout", "60"], svc.env())
    assert proc.returncode == 1 and f"job {long} cancelled" in proc.stdout
    assert not [p for p, start in tree if process_alive(p, start)]
    events = [e["state"] for e in svc.http.get(f"/api/jobs/{long}/events").json()["events"]]
    assert events == ["queued", "running", "cancelling", "cancelled"]

    # Retry: a new job, same argv and run dir plus --resume; it resumes from the checkpoint, then is cancelled.
    retried = int(last_line(run_in(["jobs", "retry", long], svc.env(), check=True).stdout))
    job = svc.job(retried)
    assert job["argv"] == [*svc.job(long)["argv"], "--resume"] and job["retry_of"] == long
    assert job["run_dir"] == svc.job(long)["run_dir"]

    def training():  # the logs endpoint shows only this job's part of RUN/job.log
        text = svc.http.get(f"/api/jobs/{retried}/logs").json()["text"]
        assert "mariana: error" not in text, text
        return "training rows" in text

    wait_for(training, 120, "the retried job trains")
    run_in(["jobs", "cancel", retried], svc.env(), check=True)
    assert run_in(["jobs", "wait", retried, "--timeout", "60"], svc.env()).returncode == 1
    assert svc.job(retried)["state"] == "cancelled"
    assert svc.job(long)["state"] == "cancelled"  # never moves backwards


def test_bad_input(service, tmp_path, run_in):
    svc = service
    assert_cli_error(run_in(["submit", "--url", svc.url, "nope", "train"]), "invalid choice: 'nope'")

    def refused(argv: list[str]) -> str:
        r = svc.http.post("/api/jobs", json={"argv": argv})
        assert r.status_code == 400, r.text
        return r.json()["detail"]

    assert "unknown command mlp 'fly'" in refused(["mlp", "fly"])
    assert "asks for 3 slots" in refused(["mlp", "train", "--data", str(FRAPPE), "--workers", "3"])
    assert "asks for 5 slots" in refused(["pctr", "train", "--servers", "2", "--workers=3"])
    assert svc.http.post("/api/jobs", json={"argv": "mlp train"}).status_code == 422

    # Oversized bodies (issue 30): 413 before parsing, never echoed back; an argv over 64 KiB is refused.
    big = json.dumps({"argv": ["mlp", "train", "x" * (20 << 20)]}).encode()
    for content in (
        big,
        iter([big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20)]),
    ):  # sized, chunked
        r = svc.http.post("/api/jobs", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 413 and len(r.content) < 200 and "too large" in r.text, r.text[:200]
    r = svc.http.post("/api/jobs", json={"argv": ["mlp", "train", "--name", "y" * (200 << 10)]})
    assert r.status_code == 422 and len(r.content) < 1000 and "argv is" in r.text, r.text[:300]
    r = svc.http.post("/api/jobs", json={"argv": ["mlp", "train"], "priority": "z" * 500_000})
    assert r.status_code == 422 and len(r.content) < 1000, r.text[:300]  # a wrong value is not echoed

    # What the command checks before it trains is checked at submit (issue 41.12): a missing --data or a
    # flag that does not parse is refused, nothing queued; what only reading the data shows fails the job.
    missing = tmp_path / "missing.libfm"
    assert f"--data {missing}: no such file or directory" in refused(["mlp", "train", "--data", str(missing)])
    assert "do not parse" in refused(["mlp", "train", "--data", str(FRAPPE), "--epochz", "2"])
    queued = [j["argv"] for j in svc.http.get("/api/jobs").json()["jobs"]]
    assert not [a for a in queued if str(missing) in a or "--epochz" in a], queued
    garbage = tmp_path / "garbage.libfm"
    garbage.write_text("not a libFM line\n")
    bad = svc.http.post("/api/jobs", json={"argv": ["mlp", "train", "--data", str(garbage)]}).json()["id"]
    proc = run_in(["jobs", "wait", bad, "--timeout", "120"], svc.env())
    assert proc.returncode == 1 and f"mariana: error: {garbage}" in proc.stdout
    job = svc.job(bad)
    assert job["state"] == "failed" and job["exit_code"] == 2
    assert job["error"] == f"mariana: error: {garbage}: no valid libFM rows"

    # Paths stay inside the run directory.
    for path in ("../../etc/passwd", "..%2F..%2F..%2Fetc%2Fpasswd", "%2Fetc%2Fpasswd", "nope.txt"):
        r = svc.http.get(f"/api/jobs/{bad}/files/{path}")
        assert 400 <= r.status_code < 500, (path, r.status_code)
        assert "root:" not in r.text
    (Path(job["run_dir"]) / "escape").symlink_to("/etc/passwd")
    assert svc.http.get(f"/api/jobs/{bad}/files/escape").status_code == 404
    assert svc.http.get(f"/api/jobs/{bad}/files/job.log").status_code == 200
    assert svc.http.get("/api/jobs/999").status_code == 404

    # No service there: one clear line (a real client process: its exit code and output).
    dead = "http://127.0.0.1:9"
    assert_cli_error(
        run_cli(["jobs", "list", "--url", dead]), f"no job service at {dead}", "mariana jobs serve"
    )


def test_token_and_off_loopback(tmp_path, run_in):
    proc = run_cli(["jobs", "serve", "--home", tmp_path / "h", "--host", "0.0.0.0", "--port", "0"])
    assert_cli_error(proc, "--host 0.0.0.0", "--token-file")
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    svc = Service(tmp_path / "h", "--token-file", str(token))
    try:
        assert svc.http.get("/api/jobs").status_code == 200  # loopback reads need no token
        body = {"argv": ["mlp", "train", "--data", str(FRAPPE)]}
        assert svc.http.post("/api/jobs", json=body).status_code == 401
        bad = {"Authorization": "Bearer wrong"}
        assert svc.http.post("/api/jobs", json=body, headers=bad).status_code == 401
        assert svc.http.post("/api/jobs/1/cancel").status_code == 401
        assert svc.http.get("/api/jobs").json()["jobs"] == []  # nothing was recorded
        ok = run_in(["submit", "--url", svc.url, "--token-file", token, "mlp", "train", "--data", FRAPPE],
                    check=True)  # fmt: skip
        job_id = int(last_line(ok.stdout))
        good = {"Authorization": "Bearer s3cret-token"}
        assert svc.http.post(f"/api/jobs/{job_id}/cancel", headers=good).status_code == 200
        wait_for(lambda: svc.job(job_id)["state"] == "cancelled", 60, "cancelled with the token")
    finally:
        svc.stop()


def test_twenty_jobs_from_four_clients_two_slots(service, tmp_path):
    """20 jobs from 4 concurrent HTTP clients (priorities 0 and 1): all recorded, each run exactly once,
    never over 2 slots, started in queue order.

    The test is about the queue, not the command: each job is ``mariana mlp eval --help``, a real job
    process (the runner and the CLI under it) that prints its usage once and exits 0 without importing
    torch (an evaluation costs seconds of CPU per job, twenty times)."""
    svc = service
    ids: list[int] = []
    errors: list[str] = []

    def client(k: int) -> None:
        with httpx.Client(base_url=svc.url, timeout=60, trust_env=False) as http:
            for i in range(5):
                argv = ["mlp", "eval", "--help"]
                body = {"argv": argv, "name": f"c{k}-{i}", "cwd": str(tmp_path), "priority": k % 2}
                r = http.post("/api/jobs", json=body)
                if r.status_code != 201:
                    errors.append(r.text)
                else:
                    ids.append(r.json()["id"])

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(ids) == list(range(1, 21))

    def all_done():
        jobs = svc.http.get("/api/jobs").json()["jobs"]
        return (
            len(jobs) == 20 and all(j["state"] in ("succeeded", "failed", "cancelled") for j in jobs) and jobs
        )

    jobs = wait_for(all_done, 300, "20 jobs finished")
    assert [j["state"] for j in jobs] == ["succeeded"] * 20, [(j["id"], j["state"], j["error"]) for j in jobs]
    assert sorted(j["name"] for j in jobs) == sorted(f"c{k}-{i}" for k in range(4) for i in range(5))
    for j in jobs:  # each ran once: one start event, one headline in its log
        events = [e["state"] for e in svc.http.get(f"/api/jobs/{j['id']}/events").json()["events"]]
        assert events == ["queued", "running", "succeeded"], (j["id"], events)
        log = (Path(j["run_dir"]) / "job.log").read_text()
        assert log.count("usage: mariana mlp eval") == 1, log
    # The slot budget from the recorded times: at no instant more than 2 jobs ran.
    edges = sorted(
        [(j["started"], 1) for j in jobs] + [(j["ended"], -1) for j in jobs], key=lambda e: (e[0], e[1])
    )
    running, peak = 0, 0
    for _, d in edges:
        running += d
        peak = max(peak, running)
    assert peak == 2
    # Queue order: a job that was waiting when another started, and ranks before it (higher priority, or
    # the same priority and submitted first), started no later. (1 s margin: `created` is stamped just
    # before the row is committed.)
    for a in jobs:
        for b in jobs:
            if (a["priority"], -a["id"]) > (b["priority"], -b["id"]) and a["created"] < b["started"] - 1:
                assert a["started"] <= b["started"], (a, b)
