"""Issue 41 points 2 and 12 (the job service): nothing the service writes lands in a folder the command
refuses (a refused job's ``job.log``/``job.exit`` live in the service's home), and what the command checks
before it trains is checked at submit (`cli.main.check_command`, also behind ``POST /api/jobs``). An
in-process scheduler over the real `LocalExecutor` (the job is a real process: the point)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

FRAPPE = Path(__file__).resolve().parents[2] / "shared" / "data" / "frappe" / "frappe.validation.libfm"


def _scheduler(home: Path):
    from mariana.platform.cli.main import build_parser, check_command
    from mariana.platform.jobs.db import Database
    from mariana.platform.jobs.scheduler import Scheduler

    db = Database(f"sqlite:///{home / 'jobs.db'}")
    return Scheduler(db, home, 1, build_parser=build_parser, check=check_command)


def test_a_refused_job_writes_nothing_into_the_users_folder(tmp_path: Path):
    from mariana.platform.jobs.db import Job
    from mariana.platform.jobs.logstore import job_files, log_error

    home, mine = tmp_path / "home", tmp_path / "mine"
    home.mkdir()
    sched = _scheduler(home)
    job = sched.submit(
        ["mlp", "train", "--data", str(FRAPPE), "--out", "mine", "--max-steps", "1"], cwd=str(tmp_path)
    )
    mine.mkdir()  # the folder became the user's between submit and start
    (mine / "notes.txt").write_text("mine")
    deadline = time.monotonic() + 180
    while True:
        sched.tick()
        with sched.db.read() as s:
            done = s.get(Job, job.id)
        if done.state not in ("queued", "running") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert done.state == "failed", done.state
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    files = job_files(home, done)
    assert files == home / "logs" / f"job-{job.id}" and (files / "job.exit").read_text().strip() == "2"
    assert "did not create" in (log_error(files, 0) or "") and "did not create" in done.error


@pytest.mark.parametrize(
    "argv,says",
    [
        (["pctr", "train", "--data", "/nonexist"], "--data /nonexist: no such file or directory"),
        (["pctr", "train", "--data", f"{FRAPPE},/nonexist.tsv"], "--data /nonexist.tsv: no such file"),
        (["mlp", "train", "--data", "rows.libfm"], "rows.libfm: no such file or directory"),
        (["mlp", "train", "--data", str(FRAPPE), "--out", "mine"], "did not create"),
    ],
)
def test_submit_refuses_what_the_command_refuses_before_training(tmp_path: Path, argv, says):
    """Relative paths name the job's folder (``cwd``), not the service's."""
    from mariana.platform.core.errors import MarianaError
    from mariana.platform.jobs.db import Job
    from sqlalchemy import select

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    (tmp_path / "home").mkdir()
    sched = _scheduler(tmp_path / "home")
    with pytest.raises(MarianaError, match=re.escape(says)):
        sched.submit(argv, cwd=str(tmp_path))
    with sched.db.read() as s:
        assert not list(s.scalars(select(Job)))
    (tmp_path / "rows.libfm").write_text("1 1:1 2:1\n")
    if "rows.libfm" in argv:  # the same relative path, present in the job's folder: queued
        assert sched.submit(argv, cwd=str(tmp_path)).state == "queued"
