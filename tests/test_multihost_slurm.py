"""The job service's Slurm executor on a two-host Slurm (``scripts/cluster-local.sh --hosts 2``, once for
this module): real munged, slurmctld and one slurmd per host (h1, h2: network namespaces on a bridge).

- a two-node data-parallel job: srun starts the torchrun agents on both hosts at once (issue 43 point 3),
  from a batch script that resubmits by hand (#SBATCH lines, point 5);
- 50 jobs pending in Slurm cost one ``squeue`` per scheduler tick, not one query per job (point 6),
  counted through a PATH shim in front of the real client commands."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from cliwalk import run_main
from helpers import DATA, ROOT, last_line, run_cli
from jobs_helpers import Service, wait_for
from mariana.platform.core.export import load_exported

SCRIPT = ROOT / "scripts" / "cluster-local.sh"
FRAPPE = DATA / "frappe" / "frappe.validation.libfm"
pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.multihost]
QUERIES = ("squeue", "scontrol", "sacct")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A running two-host Slurm; SLURM_CONF points at it for this module (services inherit it)."""
    d = tmp_path_factory.mktemp("cluster")
    env = {**os.environ, "MIN_JOB_AGE": "3"}
    p = subprocess.run(["bash", str(SCRIPT), "start", str(d), "--hosts", "2", "--owner", str(os.getpid())],
                       capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert p.returncode == 0, f"cluster-local.sh start failed:\n{p.stdout}\n{p.stderr}"
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(d / "slurm.conf")
    try:
        yield d
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(d)], capture_output=True, timeout=120)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def mlp(out: Path, *extra: str) -> list[str]:
    return ["mlp", "train", "--data", str(FRAPPE), "--out", str(out), "--preset", "debug", "--optimizer", "sgd",
            "--lr", "0.05", "--no-progress", "--max-steps", "8", *extra]  # fmt: skip


def test_two_node_job_started_by_srun_equals_one_process(cluster, tmp_path, capsys):
    svc = Service(tmp_path / "home", "--executor", "slurm", slots=4)
    try:
        argv = mlp(tmp_path / "two", "--batch-size", "32", "--workers", "1")
        out = run_cli(["submit", "--url", svc.url, "--nodes", "2", *argv], timeout=120, check=True)
        job_id = int(last_line(out.stdout))
        job = wait_for(
            lambda: (j := svc.job(job_id))["state"] not in ("queued", "running") and j, 240, "job end"
        )
        log = (tmp_path / "two" / "job.log").read_text()
        assert job["state"] == "succeeded", f"{job}\n{log[-4000:]}"
        assert "on h[1-2]" in log and "recvVector" not in log and "Traceback" not in log, log[-4000:]
        # self-contained: its #SBATCH lines ask for what the job had, so `sbatch RUN/slurm-job.sh` resubmits it
        script = tmp_path / "two" / "slurm-job.sh"
        assert {"#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1"} <= set(script.read_text().splitlines())
        test_only = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True)
        assert test_only.returncode == 0 and "to start at" in test_only.stderr, test_only.stderr
    finally:
        svc.stop()
    rc, _, err = run_main(mlp(tmp_path / "one", "--batch-size", "64"), capsys)
    assert rc == 0, err[-4000:]
    a, b = load_exported(tmp_path / "one")[0], load_exported(tmp_path / "two")[0]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def shim(bin_dir: Path, log: Path) -> None:
    """``squeue``, ``scontrol``, ``sacct`` in ``bin_dir``: each call appends its name to ``log`` and runs
    the real command."""
    bin_dir.mkdir()
    for name in QUERIES:
        real = shutil.which(name) or f"/usr/bin/{name}"
        (bin_dir / name).write_text(f'#!/bin/sh\necho {name} >> "{log}"\nexec {real} "$@"\n')
        (bin_dir / name).chmod(0o755)


def test_fifty_pending_jobs_cost_one_query_per_tick(cluster, tmp_path, monkeypatch):
    log = tmp_path / "calls.log"
    shim(tmp_path / "bin", log)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    subprocess.run(["scontrol", "update", "PartitionName=debug", "State=DOWN"], check=True, timeout=30)
    svc = Service(tmp_path / "home", "--executor", "slurm", slots=60)
    try:
        ids = [svc.http.post("/api/jobs", json={"argv": mlp(tmp_path / f"r{i}")}).raise_for_status().json()["id"]
               for i in range(50)]  # fmt: skip
        wait_for(lambda: all(svc.job(i)["external_id"] for i in ids), 120, "50 jobs handed to Slurm")
        time.sleep(1)  # the scheduler's first polls of the last jobs handed over
        log.write_text("")
        t0 = time.monotonic()
        time.sleep(4)
        calls = log.read_text().split()
        ticks = (time.monotonic() - t0) / 0.5
        counts = {q: calls.count(q) for q in QUERIES}
        print(f"queries in {ticks:.1f} ticks:", counts)
        # one squeue per tick (a tick may be woken early: a little slack), no per-job scontrol, no sacct
        assert 1 <= counts["squeue"] <= ticks + 3 and counts["scontrol"] == counts["sacct"] == 0, (
            counts,
            ticks,
        )
        assert {svc.job(i)["state"] for i in ids} == {"running"}  # handed over, pending in Slurm
        pending = subprocess.run(
            ["squeue", "-h", "-t", "pending", "-o", "%r"], capture_output=True, text=True
        )
        assert pending.stdout.split().count("PartitionDown") == 50, pending.stdout
    finally:
        subprocess.run("squeue -h -o %i | xargs -r scancel", shell=True, timeout=60)
        subprocess.run(["scontrol", "update", "PartitionName=debug", "State=UP"], timeout=30)
        svc.stop()
