"""The job service's Slurm executor against real daemons: a single-host Slurm 22.05 (munged, slurmctld,
slurmd from Debian's slurm-wlm) started once for this module by ``scripts/slurm-local.sh``.

Every test has a hard timeout (SIGALRM) and prints the daemons' logs when it fails."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import DATA, ROOT, cli_env, last_line, run_cli
from jobs_helpers import Service, wait_for
from mariana.platform.core.export import load_exported

FRAPPE = DATA / "frappe" / "frappe.validation.libfm"
SCRIPT = ROOT / "scripts" / "slurm-local.sh"
pytestmark = [pytest.mark.slow, pytest.mark.slurm]
CLUSTER: dict[str, Path] = {}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A running single-host Slurm; SLURM_CONF points at it for this module (services inherit it)."""
    d = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "MIN_JOB_AGE": "3"}  # finished jobs forgotten within seconds (the restart test)
    p = subprocess.run(
        ["bash", str(SCRIPT), "start", str(d)], capture_output=True, text=True, timeout=120, env=env
    )
    assert p.returncode == 0, f"slurm-local.sh start failed:\n{p.stdout}\n{p.stderr}"
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(d / "slurm.conf")
    CLUSTER["dir"] = d
    try:
        yield d
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(d)], capture_output=True, timeout=120)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        CLUSTER.clear()


def slurm_test(timeout_s: int):
    """A hard timeout for the test, and the daemons' logs (and Slurm's queue) printed when it fails."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            def expire(*_):
                raise TimeoutError(f"{fn.__name__}: hard timeout of {timeout_s} s")

            old = signal.signal(signal.SIGALRM, expire)
            signal.alarm(timeout_s)
            try:
                return fn(*args, **kwargs)
            except BaseException:
                dump_cluster_logs()
                raise
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old)

        return run

    return wrap


def dump_cluster_logs() -> None:
    d = CLUSTER.get("dir")
    if d is None:
        return
    for cmd in (["squeue", "-a"], ["sinfo", "-N", "-l"]):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        print(f"--- {' '.join(cmd)}\n{p.stdout}{p.stderr}")
    for log in sorted(d.glob("*.log")):
        print(f"--- {log.name} (last 60 lines)\n" + "\n".join(log.read_text().splitlines()[-60:]))


def scontrol_state(slurm_id: str) -> str | None:
    """Slurm's JobState of a job, or None once the controller has forgotten it."""
    p = subprocess.run(
        ["scontrol", "show", "job", "-o", slurm_id], capture_output=True, text=True, timeout=30
    )
    m = re.search(r"JobState=(\S+)", p.stdout)
    return m.group(1) if m else None


def slurm_processes(slurm_id: str, also: bytes = b"") -> list[int]:
    """Live processes of a Slurm job on this host (their environment names the job, and holds ``also``
    when given, e.g. ``SLURM_STEP_ID=0``)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                env = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            mine = f"SLURM_JOB_ID={slurm_id}".encode() in env and (not also or also in env)
            if mine and stat[stat.rfind(")") + 2] not in "ZX":
                out.append(int(d))
    return out


def worker_of(run_dir: str, rank: int) -> tuple[int, int] | None:
    """(pid, its launcher's pid) of the live worker process ``rank`` of a job, from the header of its log
    (``mariana: rank R on ...; pid P``) and the parent of its parent (the worker's parent is the fork server
    the launcher started); None until the worker has started."""
    from mariana.platform.runtime.launch import proc_stat

    log = Path(run_dir) / "logs" / f"rank-{rank}.log"
    heads = (
        [x for x in log.read_text().splitlines() if x.startswith(f"mariana: rank {rank} on")]
        if log.exists()
        else []
    )
    pid = int(heads[-1].rsplit("pid ", 1)[1]) if heads else 0
    server = proc_stat(pid) if pid else None
    agent = proc_stat(server[1]) if server else None
    return (pid, agent[1]) if agent else None


@pytest.fixture(scope="module")
def service(cluster, tmp_path_factory):
    svc = Service(tmp_path_factory.mktemp("slurm-home"), "--executor", "slurm", "--sbatch-arg=--comment=by-mariana",
                  slots=8)  # fmt: skip
    yield svc
    svc.stop()


def submit(svc: Service, *argv) -> int:
    return int(last_line(run_cli(["submit", "--url", svc.url, *argv], timeout=120, check=True).stdout))


def mlp(*extra) -> list:
    return ["mlp", "train", "--data", FRAPPE, "--preset", "debug", "--no-progress", *extra]


class SlurmStates:
    """The states Slurm reports for one job, polled in the background (the controller forgets a job
    MinJobAge seconds after it ends, so its final state is caught while it is still there)."""

    def __init__(self, svc: Service, job_id: int):
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(svc, job_id), daemon=True)
        self._thread.start()

    def _poll(self, svc, job_id):
        sid = wait_for(lambda: svc.job(job_id)["external_id"], 60, "the job submitted to Slurm", 0.1)
        while not self._stop.is_set():
            state = scontrol_state(sid)
            if state and (not self.seen or self.seen[-1] != state):
                self.seen.append(state)
            self._stop.wait(0.2)

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(30)
        return self.seen


@slurm_test(300)
def test_jobs_succeed_with_metrics_two_tasks_equal_one_process_and_ps_job(service, tmp_path):
    svc = service
    quick = submit(svc, *mlp("--max-steps", "5", "--log-every", "1"))
    states = SlurmStates(svc, quick)
    sid = wait_for(lambda: svc.job(quick)["external_id"], 60, "the job submitted to Slurm")
    shown = subprocess.run(["scontrol", "show", "job", "-o", sid], capture_output=True, text=True).stdout
    assert "Comment=by-mariana" in shown and "Partition=debug" in shown  # the service's --sbatch-arg
    dp = ["--optimizer", "sgd", "--lr", "0.05", "--max-steps", "8"]  # as test_dp_framework compares
    two = submit(svc, "--nodes", "1", "--tasks-per-node", "2", *mlp(*dp, "--batch-size", "32"))
    ps = ["pctr", "train", "--data", FRAPPE, "--servers", "1", "--workers", "1", "--log-every", "5",
          "--no-progress"]  # fmt: skip
    ps_job = submit(svc, "--tasks-per-node", "2", *ps, "--max-steps", "5")
    ps_dies = submit(svc, "--tasks-per-node", "2", *ps, "--max-steps", "400")
    ps_restarts = submit(svc, "--tasks-per-node", "2", *ps, "--max-steps", "200", "--ckpt-every", "20")
    ref = subprocess.Popen(  # the one-process reference, meanwhile
        [sys.executable, "-m", "mariana.platform.cli", *map(str, mlp(*dp, "--batch-size", "64")),
         "--out", str(tmp_path / "one")], cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # The task running the PS worker (rank 1) dies mid-run: the other task is ended, the job fails clearly.
    sid = wait_for(lambda: svc.job(ps_dies)["external_id"], 60, "the PS job submitted")
    wait_for(
        lambda: svc.http.get(f"/api/jobs/{ps_dies}/counters").json()["history"], 120, "the worker trains"
    )
    worker = worker_of(svc.job(ps_dies)["run_dir"], 1)
    assert worker and worker[0] in slurm_processes(sid), worker
    os.kill(worker[1], signal.SIGKILL)  # its torchrun agent
    # In another PS job only the worker process dies: its agent restarts it, the other task's agent
    # restarts its server for the new membership (its restart count stays 0), and the group re-forms.
    sid2 = wait_for(lambda: svc.job(ps_restarts)["external_id"], 60, "the restarting PS job submitted")
    wait_for(
        lambda: svc.http.get(f"/api/jobs/{ps_restarts}/counters").json()["history"], 120, "its worker trains"
    )
    worker = wait_for(lambda: worker_of(svc.job(ps_restarts)["run_dir"], 1), 30, "its worker process")
    assert worker[0] in slurm_processes(sid2), worker
    os.kill(worker[0], signal.SIGKILL)
    for job_id in (quick, two, ps_job, ps_restarts):
        proc = run_cli(["jobs", "wait", job_id, "--timeout", "240"], env=svc.env())
        assert proc.returncode == 0 and f"job {job_id} succeeded" in proc.stdout, proc.stdout + proc.stderr
    assert ref.wait(120) == 0, ref.stderr.read()
    proc = run_cli(["jobs", "wait", ps_dies, "--timeout", "120"], env=svc.env())
    # failed, with its cause (and its best metric so far when it evaluated before the kill)
    failed = re.match(rf"job {ps_dies} failed(, best \S+ [\d.]+)?: \S", proc.stdout)
    assert proc.returncode == 1 and failed, proc.stdout + proc.stderr
    print("the failed task's job:", proc.stdout)
    wait_for(lambda: not slurm_processes(sid), 30, "no process of the failed PS job left")

    # One task: submit -> running -> succeeded, metrics in the LogStore, COMPLETED in Slurm.
    job = svc.job(quick)
    assert job["executor"] == "slurm" and job["pid"] is None and job["external_id"]
    assert states.stop()[-1] == "COMPLETED" and "RUNNING" in states.seen, states.seen
    events = [e["state"] for e in svc.http.get(f"/api/jobs/{quick}/events").json()["events"]]
    assert events == ["queued", "running", "running", "succeeded"], events  # 2nd: "submitted as Slurm job"
    assert (Path(job["run_dir"]) / "slurm-job.sh").is_file()
    steps = [r["step"] for r in svc.http.get(f"/api/jobs/{quick}/metrics").json()["records"] if "loss" in r]
    assert steps == [1, 2, 3, 4, 5] and job["last_step"] == 5 and job["export"]
    assert "validation AUC" in svc.http.get(f"/api/jobs/{quick}/logs").json()["text"]

    # Two tasks: one 2-agent torchrun job whose data-parallel result equals the one-process reference.
    logs = {j: svc.http.get(f"/api/jobs/{j}/logs").json()["text"] for j in (two, ps_job)}
    ports = [re.search(r"2 torchrun agents on \S+, rendezvous at \S+:(\d+)", logs[j]).group(1) for j in logs]
    assert ports[0] != ports[1]  # every job its own rendezvous port
    assert svc.job(two)["final_metrics"]["world_size"] == 2
    a, b = load_exported(tmp_path / "one")[0], load_exported(Path(svc.job(two)["run_dir"]))[0]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)

    # The parameter-server job: server and worker as the two tasks (ranks from the rendezvous).
    job = svc.job(ps_job)
    assert "1 server(s) + 1 worker(s)" in logs[ps_job] and job["last_step"] == 5
    run = Path(job["run_dir"])
    assert (run / "logs" / "rank-0.log").is_file() and (run / "logs" / "rank-1.log").is_file()
    assert job["counters"]["workers"] and (run / "model.safetensors").is_file()
    job = svc.job(ps_restarts)  # the restarted group finished the run
    restarts = json.loads((Path(job["run_dir"]) / "counters.json").read_text())["restarts"]
    assert job["last_step"] == 200 and restarts >= 1, (job["last_step"], restarts)


@slurm_test(60)
def test_bad_submissions_end_with_a_clear_error(service):
    svc = service
    bad_part = submit(svc, "--partition", "nope", *mlp("--max-steps", "1"))
    too_many = submit(svc, "--nodes", "3", *mlp("--max-steps", "1"))
    expected = {bad_part: r"sbatch refused the job: invalid partition specified: nope",
                too_many: r"can never start: pending with reason Partition(NodeLimit|Config)"}  # fmt: skip
    for job_id, pattern in expected.items():
        proc = run_cli(["jobs", "wait", job_id, "--timeout", "40"], env=svc.env())
        assert proc.returncode == 1 and f"job {job_id} failed" in proc.stdout, proc.stdout + proc.stderr
        assert re.search(pattern, proc.stdout), proc.stdout
    assert scontrol_state(svc.job(too_many)["external_id"]) in ("CANCELLED", None)
    # Several tasks of a command that cannot rendezvous: refused at submit, one line, exit 2.
    proc = run_cli(
        ["submit", "--url", svc.url, "--nodes", "2", "mlp", "eval", "--model", "x", "--data", FRAPPE]
    )
    assert proc.returncode == 2 and "takes no --nnodes" in proc.stderr, proc.stderr


@slurm_test(300)
def test_kill9_restart_readopts_running_job_and_finishes_forgotten_one(cluster, tmp_path):
    home = tmp_path / "home"
    svc = Service(home, "--executor", "slurm", slots=8)
    try:
        long = submit(svc, *mlp("--epochs", "5000", "--log-every", "1"))  # runs until cancelled
        short = submit(svc, *mlp("--max-steps", "5", "--log-every", "1"))
        wait_for(lambda: svc.http.get(f"/api/jobs/{long}/metrics").json()["records"], 120, "long job trains")
        wait_for(lambda: svc.job(short)["external_id"], 60, "short job submitted")
        sid_long, sid_short = svc.job(long)["external_id"], svc.job(short)["external_id"]
        svc.kill9()
        run_short = home.resolve() / "runs" / f"job-{short}"
        wait_for(
            lambda: (run_short / "job.exit").is_file(), 120, "the short job ends while the service is down"
        )
        wait_for(lambda: scontrol_state(sid_short) is None, 90, "Slurm forgets the short job (MinJobAge)")
        assert scontrol_state(sid_long) == "RUNNING"
    finally:
        svc.proc.kill()
    svc = Service(home, "--executor", "slurm", slots=8)
    try:
        b = svc.job(short)  # finished from its exit file alone
        assert b["state"] == "succeeded" and b["exit_code"] == 0 and b["last_step"] == 5
        a = svc.job(long)
        assert a["state"] == "running" and a["external_id"] == sid_long
        events = [e["message"] for e in svc.http.get(f"/api/jobs/{long}/events").json()["events"]]
        assert f"re-adopted Slurm job {sid_long} after a service restart" in events
        n = len(svc.http.get(f"/api/jobs/{long}/metrics").json()["records"])
        wait_for(lambda: len(svc.http.get(f"/api/jobs/{long}/metrics").json()["records"]) > n, 60,
                 "the re-adopted job's metrics keep arriving")  # fmt: skip
        # Cancel: every process of the Slurm job ends (scancel reaches the whole job, not just the script).
        assert len(slurm_processes(sid_long)) >= 2  # the batch shell and the training process at least
        run_cli(["jobs", "cancel", long], env=svc.env(), check=True)
        wait_for(lambda: svc.job(long)["state"] == "cancelled", 60, "the re-adopted job cancelled")
        wait_for(lambda: not slurm_processes(sid_long), 30, "no process of the cancelled Slurm job left")
    finally:
        svc.stop()
