"""The apps across two hosts through the job service (issue 43 point 2): ``mariana jobs serve --executor
slurm`` + ``mariana submit --nodes 2`` on the two-host Slurm of ``scripts/cluster-local.sh --hosts 2``
(h1, h2: network namespaces on a bridge; once for this module), 1 process per host:

- ASR data parallel equals one process with the global batch (as the one-host DP tests check);
- the vision model cut into 2 pipeline stages, one per host, equals the unsplit model (as
  tests/test_pipeline_mesh.py checks);
- a parameter server on one host and a worker on the other, ``--staleness 0``, equal synchronous SGD in one
  process (as tests/test_ps_train.py checks), over the ZeroMQ transport;
- no rank reaches the other host through loopback: the rendezvous address every rank records in its log and
  the address the server announced (``RUN/counters.json``) are the hosts' bridge addresses.

The three jobs are submitted at once; the one-process references run in this process meanwhile."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from cliwalk import run_main
from helpers import DATA, ROOT, last_line
from jobs_helpers import Service, wait_for
from mariana.platform.core.export import load_exported
from test_app_registry import _asr_data
from test_pipeline_mesh import COMMON as VISION
from test_pipeline_mesh import _losses
from test_ps_train import lr_args

SCRIPT = ROOT / "scripts" / "cluster-local.sh"
FRAPPE = str(DATA / "frappe" / "frappe.validation.libfm")
pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.multihost]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A running two-host Slurm; SLURM_CONF points at it for this module (the service inherits it)."""
    d = tmp_path_factory.mktemp("cluster")
    p = subprocess.run(["bash", str(SCRIPT), "start", str(d), "--hosts", "2", "--owner", str(os.getpid())],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
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


def asr(data: Path, out: Path, batch: int, *extra) -> list:
    # debug preset: no dropout, SpecAugment or speed copies (deterministic); a feature cache per run
    return ["asr", "train", "--data", data, "--out", out, "--cache", out.parent / f"{out.name}-feats",
            "--preset", "debug", "--batch-size", str(batch), "--max-steps", "4", "--log-every", "1",
            "--no-progress", *extra]  # fmt: skip


def vision(out: Path, *extra) -> list:
    return ["vision", "train", *VISION, "--out", out, *extra]


def ps(out: Path, *extra) -> list:
    return lr_args(FRAPPE, out, "--batch-size", "512", "--no-shuffle", *extra)


TWO_HOSTS = {  # job -> (its argv on two hosts, the one-process reference's)
    "asr": (lambda d: asr(d / "asr-data", d / "asr-two", 4, "--workers", "1"),
            lambda d: asr(d / "asr-data", d / "asr-one", 8)),
    "vision": (lambda d: vision(d / "vision-two", "--workers", "1", "--model-parallel", "2", "--batch-size", "8",
                                "--micro-batches", "2"),
               lambda d: vision(d / "vision-one", "--batch-size", "8")),
    "pctr": (lambda d: ps(d / "ps-two", "--servers", "1", "--workers", "1", "--staleness", "0"),
             lambda d: ps(d / "ps-one", "--l2-emb", "0", "--schedule", "constant")),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """Every job of `TWO_HOSTS` submitted at once (``mariana submit --nodes 2`` in this process), the
    references run meanwhile -> the folder of the runs, each job's record once it ended."""
    d = tmp_path_factory.mktemp("apps")
    _asr_data(d)
    svc = Service(d / "home", "--executor", "slurm", slots=8)
    try:
        ids = {}
        for name, (two, _) in TWO_HOSTS.items():
            rc, out, err = run_main(["submit", "--url", svc.url, "--nodes", "2", *two(d)])
            assert rc == 0, err[-4000:]
            ids[name] = int(last_line(out))
        for name, (_, one) in TWO_HOSTS.items():
            rc, _, err = run_main(one(d))
            assert rc == 0, f"{name} reference: {err[-4000:]}"
        ended = lambda i: (j := svc.job(i))["state"] not in ("queued", "running") and j  # noqa: E731
        return d, {name: wait_for(lambda i=i: ended(i), 300, f"{name} job") for name, i in ids.items()}
    finally:
        svc.stop()


def ran_on_both_hosts(run: Path, job: dict) -> None:
    """The job succeeded, one rank per host, and no rank met the other through loopback: each rank's log
    names its host, the address its hostname resolves to (gloo binds it) and the rendezvous store."""
    log = (run / "job.log").read_text()
    assert job["state"] == "succeeded", f"{job}\n{log[-4000:]}"
    assert "on h[1-2]" in log and "Traceback" not in log and "recvVector" not in log, log[-4000:]
    seen = {}
    for r in (0, 1):
        m = re.search(r"mariana: rank \d on (h\d) \(([\d.]+)\); rendezvous store (\S+):\d+",
                      (run / "logs" / f"rank-{r}.log").read_text())  # fmt: skip
        assert m, f"rank {r} recorded no host"
        seen[m[1]] = m[2]
        assert not ipaddress.ip_address(m[2]).is_loopback and m[3] == "h1", m.group(0)
    assert sorted(seen) == ["h1", "h2"] and len(set(seen.values())) == 2, seen


def test_asr_data_parallel_on_two_hosts_equals_one_process(runs):
    d, jobs = runs
    ran_on_both_hosts(d / "asr-two", jobs["asr"])
    assert json.loads((d / "asr-two" / "metrics.json").read_text())["world_size"] == 2
    two, one = load_exported(d / "asr-two")[0], load_exported(d / "asr-one")[0]
    assert two.keys() == one.keys()
    for k in one:  # 2 x 4 utterances, gradients all-reduced = one batch of the same 8
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-5, msg=k)


def test_vision_pipeline_stages_on_two_hosts_equal_the_unsplit_model(runs):
    d, jobs = runs
    ran_on_both_hosts(d / "vision-two", jobs["vision"])
    stages = {r: json.loads((d / "vision-two" / "logs" / f"pipeline-rank-{r}.json").read_text())["stage"]
              for r in (0, 1)}  # fmt: skip
    assert stages == {0: 0, 1: 1}
    assert _losses(d / "vision-two") == pytest.approx(_losses(d / "vision-one"), rel=1e-4, abs=1e-5)
    two, one = load_exported(d / "vision-two")[0], load_exported(d / "vision-one")[0]
    assert two.keys() == one.keys()
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=1e-5, rtol=1e-4, msg=k)


def test_parameter_server_and_worker_on_two_hosts_equal_synchronous_sgd(runs):
    d, jobs = runs
    ran_on_both_hosts(d / "ps-two", jobs["pctr"])
    server = json.loads((d / "ps-two" / "counters.json").read_text())["servers"]["server-0"]
    host = server["address"].rpartition(":")[0]  # what the server announced, the worker reached it there
    assert not ipaddress.ip_address(host).is_loopback, server["address"]
    two, one = load_exported(d / "ps-two")[0], load_exported(d / "ps-one")[0]
    metrics = [json.loads((d / r / "metrics.json").read_text()) for r in ("ps-two", "ps-one")]
    assert metrics[0]["steps"] == metrics[1]["steps"] == 90
    for k in ("table.weight", "bias", "seen"):
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-5, msg=k)
    assert (one["table.weight"] != 0).sum() > 1000  # it really trained
