"""A lost host (issue 43 point 4) on a two-host Slurm (``scripts/cluster-local.sh --hosts 2``, once for this
module) through the job service: every process of a ``--nodes 2`` job on one host is SIGKILLed (slurmd
lives on) once the run has a checkpoint; `batch_script` requeues the job, since this attempt wrote a
checkpoint, and the requeued job resumes from it.

- data parallel (mlp, 1 worker per host): ends equal to the one-process run of the double batch;
- parameter servers (pctr, ``--servers 1 --workers 1 --staleness 0``): the server's host is lost (read from
  its log line), the server restores its shard from the last checkpoint, the model is bit-for-bit the
  uninterrupted run's (as tests/test_ps_train.py's killed-server test);
- a job failing before any checkpoint (an injected ``raise``) fails at once, never requeued.

The three jobs and both reference runs start together as the module starts."""

from __future__ import annotations

import contextlib
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
from helpers import ROOT, cli_env
from jobs_helpers import Service, wait_for
from mariana.platform.core.export import load_exported
from test_jobs_slurm import slurm_processes, slurm_test
from test_multihost_slurm import FRAPPE, cluster  # noqa: F401  (the fixture)
from test_slurm_requeue import wait_releasing

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.multihost]
PS = ["pctr", "train", "--data", str(FRAPPE), "--format", "libfm", "--preset", "debug", "--servers", "1",
      "--workers", "1", "--staleness", "0", "--ckpt-every", "10", "--max-steps", "80", "--no-progress"]  # fmt: skip


def mlp(out: Path, *extra: str) -> list[str]:
    return ["mlp", "train", "--data", str(FRAPPE), "--out", str(out), "--preset", "debug", "--optimizer", "sgd",
            "--lr", "0.05", "--no-progress", "--max-steps", "30", "--ckpt-every", "10", *extra]  # fmt: skip


def background(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mariana.platform.cli", *map(str, argv)], cwd=ROOT,
                            env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip


class LoseHost:
    """In the background: once the run in ``out`` of job ``job_id`` has a checkpoint, SIGKILL every process
    of the job on the host ``host(out)`` names (slurmd and its slurmstepd live on)."""

    def __init__(self, svc: Service, job_id: int, out: Path, host):
        self.job_id, self.host, self.killed, self.error = job_id, None, [], None
        self.thread = threading.Thread(target=self._run, args=(svc, out, host), daemon=True)
        self.thread.start()

    def _run(self, svc, out, host):
        try:
            sid = wait_for(lambda: svc.job(self.job_id)["external_id"], 60, "the job submitted to Slurm")

            # Both ranks have started (their logs exist): the host's processes are found before the checkpoint,
            # so the kill lands within milliseconds of it, well before the run's end (30 steps take under a
            # second once started; a scan of /proc and a `kill` process per signal after it once came late).
            def started():  # -> the lost host's name once both ranks' logs exist
                return all((out / "logs" / f"rank-{r}.log").is_file() for r in (0, 1)) and host(out)

            self.host = wait_for(started, 240, "both ranks started", 0.05)
            # the step's processes (the torchrun agent, its workers), not the batch shell or srun of h1
            here = set(slurm_processes(sid, f"SLURMD_NODENAME={self.host}".encode()))
            self.killed = sorted(here & set(slurm_processes(sid, b"SLURM_STEP_ID=0")))
            wait_for(lambda: (out / "checkpoints" / "latest").is_file(), 240, "a checkpoint", 0.01)
            # stopped first: no agent restarts a worker meanwhile
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                for pid in self.killed:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
        except BaseException as e:  # noqa: BLE001  (reported by `done`)
            self.error = e

    def done(self, svc: Service) -> str:
        """Wait for the job's end; asserts it was requeued once after the kill and succeeded; its log."""
        self.thread.join(300)
        assert self.error is None and len(self.killed) >= 2, (self.error, self.killed)  # agent and worker
        state = wait_releasing(svc, self.job_id)
        log = svc.http.get(f"/api/jobs/{self.job_id}/logs").json()["text"]
        assert state == "succeeded", state + "\n" + log
        assert "(a host lost?) after checkpoint" in log and "requeued (1), resuming" in log, log
        return log


def submit(svc: Service, argv: list) -> int:
    """A ``--nodes 2`` job (through the API: no client process to start); its id."""
    body = {"argv": [str(a) for a in argv], "resources": {"nodes": 2}}
    return svc.http.post("/api/jobs", json=body).raise_for_status().json()["id"]


def server_host(out: Path) -> str | None:
    """The host of server 0, from its log line ``server 0 serves at ADDR on host H``."""
    m = re.search(r"server 0 serves at \S+ on host (\S+)", (out / "logs" / "rank-0.log").read_text())
    return m and m.group(1)  # None until the server has logged it


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):  # noqa: F811
    """The three jobs (each in the service that runs it), started with the reference runs."""
    d = tmp_path_factory.mktemp("faults")
    svc = Service(d / "home", "--executor", "slurm", slots=8)
    # Only the failing job's service carries the fault (a bug: ValueError on rank 1 before step 3).
    bad = Service(
        d / "bad-home", "--executor", "slurm", "--sbatch-arg=--export=ALL,MARIANA_FAULT=raise:rank=1:step=3"
    )
    refs = {}
    try:
        dp = submit(svc, mlp(d / "dp", "--batch-size", "32", "--workers", "1"))
        ps = submit(svc, [*PS, "--out", d / "ps"])
        failing = submit(bad, mlp(d / "bad", "--workers", "1"))
        lost = {
            "dp": LoseHost(svc, dp, d / "dp", lambda _: "h2"),
            "ps": LoseHost(svc, ps, d / "ps", server_host),
        }
        refs.update(
            dp=background(mlp(d / "dp-ref", "--batch-size", "64")),
            ps=background([*PS, "--out", d / "ps-ref"]),
        )
        yield {"svc": svc, "bad": bad, "dir": d, "refs": refs, "failing": failing, **lost}
    finally:
        for p in refs.values():
            p.kill()
            p.wait()
        svc.stop()
        bad.stop()


def reference(jobs, name: str) -> Path:
    p = jobs["refs"][name]
    assert p.wait(300) == 0, p.stderr.read()
    return jobs["dir"] / f"{name}-ref"


@slurm_test(300)
def test_data_parallel_job_losing_a_host_requeues_and_ends_equal(jobs):
    lost = jobs["dp"]
    log = lost.done(jobs["svc"])
    resumed = re.search(r"resumed from step (\d+)", log)
    assert resumed and int(resumed.group(1)) >= 10, log  # from a checkpoint, not from scratch
    assert jobs["svc"].job(lost.job_id)["last_step"] == 30
    got, want = load_exported(jobs["dir"] / "dp")[0], load_exported(reference(jobs, "dp"))[0]
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)


@slurm_test(300)
def test_parameter_server_host_lost_restores_its_shard_and_loses_no_update(jobs):
    lost = jobs["ps"]
    log = lost.done(jobs["svc"])
    out = jobs["dir"] / "ps"
    step = int(re.search(r"after checkpoint step_0*(\d+)", log).group(1))
    server = json.loads((out / "counters" / "server-0.json").read_text())
    assert server["restored_from"] == step > 0, (server, log)
    assert f"restored shard from checkpoint step {step}" in (out / "logs" / "rank-0.log").read_text()
    ref = reference(jobs, "ps")
    got, want = load_exported(out)[0], load_exported(ref)[0]
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k  # bit-for-bit: no acknowledged update lost or doubled
    metrics = [json.loads((r / "metrics.json").read_text()) for r in (out, ref)]
    assert metrics[0]["steps"] == metrics[1]["steps"] == 80
    assert metrics[0]["val_auc"] == metrics[1]["val_auc"]


@slurm_test(300)
def test_job_failing_before_any_checkpoint_is_not_requeued(jobs):
    bad, job_id = jobs["bad"], jobs["failing"]
    wait_for(lambda: bad.job(job_id)["state"] not in ("queued", "running"), 240, "the failing job's end")
    log = bad.http.get(f"/api/jobs/{job_id}/logs").json()["text"]
    assert bad.job(job_id)["state"] == "failed" and "injected fault before step 3" in log, log
    assert "requeue" not in log, log
