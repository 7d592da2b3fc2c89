"""The job service on PostgreSQL: the same ``--db-url postgresql://...`` a team would use, against a
throwaway cluster started here with the Debian package's ``initdb``/``pg_ctl`` (``apt-get install
postgresql``) and the psycopg driver from requirements.txt. Skipped, with the reason, when either is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers import DATA, free_port
from jobs_helpers import Service, wait_for

pytestmark = pytest.mark.slow
PG_BIN = Path("/usr/lib/postgresql")


def _pg_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(PG_BIN.glob(f"*/bin/{name}"))
    return str(versions[-1]) if versions else None


@pytest.fixture
def postgres(tmp_path):
    initdb, pg_ctl = _pg_tool("initdb"), _pg_tool("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("PostgreSQL server binaries not installed (apt-get install postgresql)")
    pytest.importorskip("psycopg", reason="psycopg not installed (pip install -r requirements.txt)")
    # Not under tmp_path: pytest's folders are private to root, and the server runs as `postgres`.
    root = Path(tempfile.mkdtemp(prefix="mariana-pg-"))
    data = root / "pg"
    data.mkdir()
    prefix: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root: run the cluster as the postgres user
        shutil.chown(root, "postgres")
        shutil.chown(data, "postgres")
        prefix = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    subprocess.run([*prefix, initdb, "-D", str(data), "-A", "trust", "-U", "mariana", "--no-sync"], check=True,
                   capture_output=True, cwd=root)  # fmt: skip
    opts = f"-c listen_addresses=127.0.0.1 -p {port} -k {data} -c fsync=off"
    subprocess.run([*prefix, pg_ctl, "-D", str(data), "-o", opts, "-l", str(data / "log"), "-w", "start"],
                   check=True, capture_output=True, cwd=root)  # fmt: skip
    try:
        yield f"postgresql://mariana@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True, cwd=root
        )
        shutil.rmtree(root, ignore_errors=True)


def test_service_on_postgresql(postgres, tmp_path):
    small = tmp_path / "small.libfm"
    with open(DATA / "frappe" / "frappe.validation.libfm") as f:
        small.write_text("".join(line for _, line in zip(range(400), f)))
    svc = Service(tmp_path / "home", "--db-url", postgres)
    try:
        assert svc.http.get("/healthz").json()["db"].startswith("postgresql+psycopg://mariana@")
        argv = ["mlp", "train", "--data", str(small), "--max-steps", "6", "--log-every", "2", "--batch-size", "32",
                "--no-progress"]  # fmt: skip
        r = svc.http.post("/api/jobs", json={"argv": argv})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        job = wait_for(
            lambda: (j := svc.job(job_id))["state"] in ("succeeded", "failed") and j, 180, "job ends"
        )
        assert job["state"] == "succeeded" and job["final_metrics"]["steps"] == 6, job
        steps = [
            r["step"] for r in svc.http.get(f"/api/jobs/{job_id}/metrics").json()["records"] if "loss" in r
        ]
        assert steps == [2, 4, 6]
        assert not (tmp_path / "home" / "jobs.db").exists()  # nothing went to SQLite
    finally:
        svc.stop()
