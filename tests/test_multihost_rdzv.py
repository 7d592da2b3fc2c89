"""The multi-node command on two hosts started the way cluster launchers start it (issue 43 point 3).

Two hosts h1, h2 on this machine (``scripts/cluster-local.sh --hosts 2 --no-slurm``, once for this module):
network namespaces with their own address on a private bridge, hostname and /etc/hosts. Ranks on different
hosts reach each other only through the bridge (127.0.0.1 is each host's own). The one-process reference
run goes through the CLI's entry point in this process, as in the one-host DP tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cliwalk import run_main
from helpers import DATA, ROOT, cli_env
from mariana.platform.core.export import load_exported

SCRIPT = ROOT / "scripts" / "cluster-local.sh"
FRAPPE = DATA / "frappe" / "frappe.validation.libfm"
pytestmark = [pytest.mark.slow, pytest.mark.multihost]
PORT = 29555  # on h1's own address: nothing else listens in its network namespace
STACK_DUMP = ("recvVector", "Exception raised from", "Traceback")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """The cluster's directory, with two hosts up; removed afterwards."""
    d = tmp_path_factory.mktemp("hosts")
    p = subprocess.run(
        ["bash", str(SCRIPT), "start", str(d), "--hosts", "2", "--no-slurm", "--owner", str(os.getpid())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, f"cluster-local.sh start failed:\n{p.stdout}\n{p.stderr}"
    try:
        yield d
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(d)], capture_output=True, timeout=120)


def mlp_args(out, *extra):
    return ["mlp", "train", "--data", FRAPPE, "--out", out, "--preset", "debug", "--optimizer", "sgd",
            "--lr", "0.05", "--no-progress", "--max-steps", "8", *extra]  # fmt: skip


def on_host(
    hosts: Path, host: str, out: Path, wait_s: int = 120, extra=(), argv=None, env=None
) -> subprocess.Popen:
    """``mariana mlp train ... --nnodes 2 --workers 1 --rdzv-endpoint h1:PORT`` (or ``argv`` with
    ``--nnodes 2 --rdzv-endpoint h1:PORT``) started on ``host``."""
    if argv is None:
        argv = mlp_args(out, "--batch-size", "32", "--workers", "1", *extra)
    argv = [*argv, "--nnodes", "2", "--rdzv-endpoint", f"h1:{PORT}"]
    cmd = ["bash", str(SCRIPT), "exec", str(hosts), host, sys.executable, "-m", "mariana.platform.cli"]
    env = cli_env({"MARIANA_RDZV_WAIT": str(wait_s), **(env or {})})
    return subprocess.Popen([*cmd, *map(str, argv)], env=env, cwd=ROOT, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def kill(p: subprocess.Popen) -> None:
    """SIGKILL ``p`` and what it started: its session (the launcher, torchrun's agent) and the workers,
    which torchrun starts in sessions of their own (found by the launcher's command line)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    argv = p.args[p.args.index("mariana.platform.cli") + 1 :]
    tail = b"\0".join(str(a).encode() for a in argv) + b"\0"
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if cmdline.read_bytes().endswith(tail):
                os.kill(int(cmdline.parent.name), signal.SIGKILL)


def finish(p: subprocess.Popen, timeout: float = 180) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(p)
        out, err = p.communicate()
        pytest.fail(f"no end within {timeout} s:\n{out[-2000:]}\n{err[-4000:]}")
    return p.returncode, out, err


def wait_for_line(p: subprocess.Popen, fragment: str, timeout: float = 60) -> str:
    """Read ``p``'s stderr until a line containing ``fragment``; returns the lines read."""
    os.set_blocking(p.stderr.fileno(), True)
    seen, t0 = "", time.monotonic()
    while time.monotonic() - t0 < timeout:
        line = p.stderr.readline()
        seen += line
        if fragment in line or not line:
            return seen
    return seen


def test_second_host_first_waits_and_the_job_equals_one_process(hosts, tmp_path, capsys):
    """h2 started before h1 (as srun may): it waits for h1's store with one line, then both train;
    the model equals the one-process run with the double batch, and no host prints a C++ stack dump."""
    h2 = on_host(hosts, "h2", tmp_path / "h2")
    waited = wait_for_line(h2, "waiting up to")
    assert f"waiting up to 120 s for the rendezvous at h1:{PORT}" in waited, waited
    h1 = on_host(hosts, "h1", tmp_path / "h1")
    rc1, out1, err1 = finish(h1)
    rc2, out2, err2 = finish(h2)
    err2 = waited + err2
    assert rc1 == 0 and rc2 == 0, f"h1:\n{err1[-4000:]}\nh2:\n{err2[-4000:]}"
    assert out1.strip().splitlines()[-1].startswith("validation AUC"), out1
    for err in (err1, err2):
        assert not any(s in err for s in STACK_DUMP), err[-4000:]
    rc, _, err = run_main(mlp_args(tmp_path / "one", "--batch-size", "64"), capsys)
    assert rc == 0, err[-4000:]
    a, b = load_exported(tmp_path / "one")[0], load_exported(tmp_path / "h1")[0]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def test_a_host_that_never_comes_is_one_line_within_the_wait(hosts, tmp_path):
    """h1 alone: its rendezvous ends after the stated wait with one line naming it; h2 alone (no h1):
    it waits the stated time, then is refused with one line. Neither hangs nor prints a stack dump."""
    t0 = time.monotonic()
    rc, _, err = finish(on_host(hosts, "h1", tmp_path / "h1", wait_s=8), timeout=60)
    took = time.monotonic() - t0
    assert rc == 1 and f"rendezvous at h1:{PORT} failed: not all 2 nodes joined within 8 s" in err, err
    assert took < 8 + 30 and not any(s in err for s in STACK_DUMP), (took, err)
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1, err

    t0 = time.monotonic()
    rc, _, err = finish(on_host(hosts, "h2", tmp_path / "h2", wait_s=4), timeout=60)
    took = time.monotonic() - t0
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 2, err
    assert lines[0].startswith(f"mariana: waiting up to 4 s for the rendezvous at h1:{PORT}"), err
    assert "cannot connect for 4 s (Connection refused)" in lines[1], err
    assert 4 <= took < 4 + 20, took


def test_any_interface_address_is_this_host(hosts):
    """The bridge's address is this machine's (a second interface; the hostname resolves elsewhere): the
    endpoint check connects to nothing there and torchrun is told that this node hosts the store."""
    from mariana.platform.core.config import LaunchSection
    from mariana.platform.core.endpoint import is_this_host
    from mariana.platform.runtime.launch import launch_config

    bridge = (hosts / "hosts").read_text().splitlines()[2].split()[0]  # "10.231.X.1 <this hostname>"
    assert is_this_host(bridge) and not is_this_host(bridge.rsplit(".", 1)[0] + ".11"), bridge
    conf = launch_config(1, LaunchSection(nnodes=2, rdzv_endpoint=f"{bridge}:{PORT}")).rdzv_configs
    assert conf.get("is_host") is True, conf


def cut_off(hosts: Path, cut: str, procs: dict, ready, timeout: float = 60) -> dict:
    """Once ``ready()``, take host ``cut``'s link down; wait for every host's process in ``procs`` (host ->
    Popen) to end; reconnect. Returns host -> (exit code, console error lines, stderr, seconds after the cut)."""
    out = {}
    try:
        t0 = time.monotonic()
        while not ready() and time.monotonic() - t0 < 120:
            time.sleep(0.2)
        subprocess.run(["bash", str(SCRIPT), "link", str(hosts), cut, "down"], check=True)
        t0 = time.monotonic()
        for host, p in procs.items():
            rc, _, err = finish(p, timeout)
            errors = [ln for ln in err.splitlines() if ln.startswith("mariana: error:")]
            out[host] = (rc, errors, err, time.monotonic() - t0)
    finally:
        subprocess.run(["bash", str(SCRIPT), "link", str(hosts), cut, "up"], check=True)
        for p in procs.values():
            kill(p)
            p.communicate()
    return out


def test_a_host_cut_off_mid_run_fails_the_job_naming_it(hosts, tmp_path):
    """h2's link goes down once both hosts train: h1 ends within 120 s (here: --timeout 10, so the peer timeout is
    5 s) with one line naming the lost host h2; h2, cut off, ends too, naming h1 (its store); no stack dump."""
    argv = ["--max-steps", "100000", "--timeout", "10"]
    procs = {h: on_host(hosts, h, tmp_path / h, extra=argv) for h in ("h1", "h2")}
    ends = cut_off(hosts, "h2", procs, (tmp_path / "h1" / "metrics.jsonl").exists)
    (rc1, errors1, err1, took1), (rc2, errors2, err2, took2) = ends["h1"], ends["h2"]
    assert rc1 == 1 and len(errors1) == 1 and "lost host h2 (rank(s) [1])" in errors1[0], err1
    assert rc2 == 1 and len(errors2) == 1 and "lost host h1 (the job's store)" in errors2[0], err2
    for err, took in ((err1, took1), (err2, took2)):
        assert not any(s in err for s in STACK_DUMP) and took < 60, (took, err)


def test_a_ps_worker_host_cut_off_ends_both_hosts_naming_each_other(hosts, tmp_path):
    """Parameter servers, the server on one host, the worker on the other (ranks follow the rendezvous);
    the worker's host is cut off mid-run: with a 5 s peer timeout the server's host ends at once with
    one line naming the worker's host, and the cut-off host with one naming the server's; both within
    60 s, exit 1, no stack dump, no restart (a restart would wait for the lost host)."""
    ps = ["pctr", "train", "--data", FRAPPE, "--format", "libfm", "--preset", "debug", "--servers", "1",
          "--workers", "1", "--staleness", "0", "--max-steps", "1000000", "--no-progress"]  # fmt: skip
    env = {"MARIANA_PS_PEER_TIMEOUT_S": "5"}
    procs = {
        h: on_host(hosts, h, tmp_path / h, argv=[*ps, "--out", tmp_path / h], env=env) for h in ("h1", "h2")
    }

    def serving() -> str | None:
        logs = [p for h in procs for p in (tmp_path / h / "logs").glob("rank-*.log")]
        return next((p.parent.parent.name for p in logs if "serves at" in p.read_text()), None)

    def ready() -> bool:  # the worker has trained and logged its first steps
        counters = [p for h in procs for p in (tmp_path / h / "counters").glob("worker-*.jsonl")]
        return serving() is not None and any(p.stat().st_size > 0 for p in counters)

    t0 = time.monotonic()
    while not ready() and time.monotonic() - t0 < 120:
        time.sleep(0.2)
    server = serving()
    worker = "h2" if server == "h1" else "h1"
    ends = cut_off(hosts, worker, procs, ready)
    (rc_s, errors_s, err_s, took_s), (rc_w, errors_w, err_w, took_w) = ends[server], ends[worker]
    assert rc_s == 1 and errors_s == [
        f"mariana: error: lost host {worker} (worker 0): no heartbeat for 5 s (see {tmp_path / server}/logs/)"
    ], err_s
    assert rc_w == 1 and len(errors_w) == 1 and f"lost host {server} (server 0 at " in errors_w[0], err_w
    for err, took in ((err_s, took_s), (err_w, took_w)):
        assert not any(s in err for s in STACK_DUMP) and took < 60, (took, err)
