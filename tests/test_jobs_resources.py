"""Job resources (``mariana submit --nodes ... --time ...``): checked, stored, refused by the local
executor with one clear line; a database made before these columns existed keeps working."""

from __future__ import annotations

import sqlite3
import time

import pytest
from mariana.platform.cli.main import build_parser
from mariana.platform.core.errors import MarianaError
from mariana.platform.jobs.db import Database, Job
from mariana.platform.jobs.resources import normalize
from mariana.platform.jobs.scheduler import Scheduler

ARGV = ["mlp", "train", "--data", "x.libfm"]


def test_local_executor_refuses_what_it_cannot_honour_and_stores_the_rest(tmp_path):
    db = Database(f"sqlite:///{tmp_path / 'jobs.db'}")
    sched = Scheduler(db, tmp_path, slots=2, build_parser=build_parser)
    for resources, expected in (
        ({"nodes": 2}, "--nodes 2: the local executor runs one task"),
        ({"tasks_per_node": 2, "time": "10"}, "--tasks-per-node 2 --time 10: the local executor"),
        ({"partition": "gpu"}, "--partition gpu: the local executor"),
        ({"gpus_per_node": 64}, "--gpus-per-node 64: this host has"),
        ({"cpus_per_task": 100000}, "--cpus-per-task 100000: this host has"),
        ({"nodes": 0}, "--nodes 0: expected an integer >= 1"),
        ({"time": "soon"}, "--time 'soon': expected minutes"),
        ({"memory": 4}, "resources: unknown field 'memory'"),
    ):
        with pytest.raises(MarianaError) as e:
            sched.submit(ARGV, resources=resources)
        assert str(e.value).startswith(expected) and "\n" not in str(e.value), str(e.value)
    job = sched.submit(ARGV, resources={"cpus_per_task": 1, "nodes": 1, "gpus_per_node": 0})
    assert job.resources == {"cpus_per_task": 1} and job.executor == "local"  # defaults are not stored
    assert job.to_dict()["resources"] == {"cpus_per_task": 1}
    assert normalize({"nodes": 4, "time": "1-12:00:00", "partition": "gpu"}) == {
        "nodes": 4,
        "time": "1-12:00:00",
        "partition": "gpu",
    }


def test_database_from_before_the_resource_columns_keeps_working(tmp_path):
    path = tmp_path / "jobs.db"
    Database(f"sqlite:///{path}").engine.dispose()
    con = sqlite3.connect(path)  # the table as an older version made it, with one job in it
    for col in ("resources", "executor", "external_id"):
        con.execute(f"ALTER TABLE jobs DROP COLUMN {col}")
    con.execute(
        "INSERT INTO jobs (name, app, command, argv, cwd, state, priority, slots, created, run_dir, log_offset, "
        "cancel_requested) VALUES ('old', 'mlp', 'train', '[\"mlp\", \"train\"]', '', 'succeeded', 0, 1, ?, "
        "'/r', 0, 0)",
        (time.time(),),
    )
    con.commit()
    con.close()
    db = Database(f"sqlite:///{path}")  # adds the missing nullable columns
    with db.read() as s:
        old = s.get(Job, 1)
        assert old.to_dict()["resources"] == {} and old.to_dict()["executor"] == "local"
    with db.write() as s:
        s.add(Job(app="mlp", command="train", argv=[], created=time.time(), resources={"nodes": 2}))
    with db.read() as s:
        assert s.get(Job, 2).resources == {"nodes": 2}
