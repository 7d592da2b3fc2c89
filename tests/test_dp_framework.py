"""The data-parallel framework end to end: real torchrun workers over gloo on loopback. The one-process
reference runs (and a refused command line) go through the CLI's entry point in this process (`run_main`):
no interpreter of their own, the same parser, config and training code as ``mariana`` in a shell."""

import json
import time

import pytest
import torch
from cliwalk import run_main
from helpers import last_line, run_cli
from mariana.platform.core.export import load_exported

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def frappe(data_dir):
    return data_dir / "frappe" / "frappe.validation.libfm"


def mlp_args(data, out, *extra):
    # SGD (not Adam) so that float sum-order differences are not amplified by the 1/sqrt(v) normaliser.
    return [
        "mlp",
        "train",
        "--data",
        data,
        "--out",
        out,
        "--preset",
        "debug",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--no-progress",
        *extra,
    ]


def params(run):
    return load_exported(run)[0]


# two data-parallel workers, batch 32 each, 8 steps (fp32 gradient all-reduce, the default)
TWO = ["--batch-size", "32", "--max-steps", "8", "--workers", "2"]


@pytest.fixture(scope="module")
def two_workers(frappe, tmp_path_factory):
    """The TWO run (with a progress bar asked for and a checkpoint at step 4): (run dir, its process);
    shared by the equivalence and the bf16 tests."""
    out = tmp_path_factory.mktemp("dp") / "two"
    return out, run_cli(mlp_args(frappe, out, *TWO, "--progress", "--ckpt-every", "4"), check=True)


def in_process(args: list, capsys) -> None:
    """``mariana <args>`` in this process (a one-process run: no launcher); asserts a zero exit."""
    rc, out, err = run_main(args, capsys)
    assert rc == 0, f"mariana {args} exited {rc}\n{out[-4000:]}\n{err[-8000:]}"


def test_two_workers_equal_one_process_with_double_batch(frappe, two_workers, tmp_path, capsys):
    in_process(mlp_args(frappe, tmp_path / "one", "--batch-size", "64", "--max-steps", "8"), capsys)
    two, p = two_workers
    assert last_line(p.stdout).startswith("validation AUC")
    # piped output (issue 30): no progress-bar frames, no DEBUG lines (checkpoints go to RUN/logs only)
    assert "step/s" not in p.stderr and "DEBUG" not in p.stderr, p.stderr[-2000:]
    assert "checkpoint at step 4 written" in (two / "logs" / "rank-0.log").read_text()
    a, b = params(tmp_path / "one"), params(two)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    # Training moved the parameters (the comparison is not between two untouched inits).
    init = tmp_path / "zero"
    in_process(mlp_args(frappe, init, "--batch-size", "64", "--max-steps", "1", "--lr", "0"), capsys)
    assert not torch.allclose(params(init)["embed.weight"], a["embed.weight"])


def test_resume_after_kill_equals_uninterrupted(frappe, tmp_path, capsys):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    common = [
        "--workers",
        "2",
        "--max-steps",
        "12",
        "--ckpt-every",
        "6",
        "--optimizer",
        "adam",
        "--lr",
        "0.01",
    ]
    run_cli(mlp_args(frappe, straight, *common), check=True)
    p = run_cli(mlp_args(frappe, broken, *common), env={"MARIANA_FAULT": "kill:rank=1:step=8"})
    assert p.returncode != 0, "the injected SIGKILL should fail a job without restarts"
    assert (broken / "checkpoints" / "latest").read_text().strip() == "step_00000006"
    rc, _, err = run_main(mlp_args(frappe, broken, *common), capsys)
    assert rc == 2 and "--resume" in err  # never silently overwrite a trained run
    run_cli(mlp_args(frappe, broken, *common, "--resume"), check=True)
    a, b = params(straight), params(broken)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    steps = [
        r["step"] for r in map(json.loads, (broken / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]
    assert steps[-1] == 12


def test_sigkilled_worker_is_restarted_and_resumes(frappe, tmp_path):
    out = tmp_path / "fault"
    p = run_cli(
        mlp_args(
            frappe, out, "--workers", "2", "--max-steps", "20", "--ckpt-every", "5", "--max-restarts", "1"
        ),
        env={"MARIANA_FAULT": "kill:rank=1:step=12"},
        check=True,
    )
    assert json.loads((out / "metrics.json").read_text())["steps"] == 20
    assert "resumed from step 10" in (out / "logs" / "rank-0.log").read_text()
    state = torch.load(out / "checkpoints" / "step_00000020" / "state.pt", weights_only=True)
    assert state["step"] == 20
    assert last_line(p.stdout).startswith("validation AUC")


def test_stalled_rank_fails_job_within_timeout_and_is_named(frappe, tmp_path):
    out = tmp_path / "hang"
    t0 = time.monotonic()
    p = run_cli(
        mlp_args(frappe, out, "--workers", "2", "--max-steps", "50", "--timeout", "6"),
        env={"MARIANA_FAULT": "hang:rank=1:step=4"},
        timeout=120,
    )
    elapsed = time.monotonic() - t0
    assert p.returncode != 0
    assert elapsed < 60, f"took {elapsed:.0f}s"
    assert "stalled rank(s): [1]" in p.stderr
    assert "Traceback" not in p.stderr and "Thread 0x" not in p.stderr  # stack dumps go to the rank logs
    logs = "".join(f.read_text() for f in sorted((out / "logs").glob("rank-*.log")))
    assert "Python stacks of rank" in logs
    # Both ranks' stacks are in the logs: the stalled one sleeping in the fault injector, the other waiting.
    assert "faults.py" in logs and logs.count("Thread 0x") + logs.count("Current thread") >= 2


def test_bf16_gradient_comm_halves_bytes(frappe, two_workers, tmp_path):
    """The TWO run with --grad-comm bf16 sends half the bytes per step of the same run in fp32."""
    run_cli(mlp_args(frappe, tmp_path / "bf16", *TWO, "--grad-comm", "bf16"), check=True)
    rec = {
        c: json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
        for c, run in (("fp32", two_workers[0]), ("bf16", tmp_path / "bf16"))
    }
    assert rec["bf16"]["step"] == rec["fp32"]["step"]  # the same logging window (comm_bytes is per step)
    assert rec["bf16"]["comm_bytes"] * 2 == rec["fp32"]["comm_bytes"] > 0


def test_one_fault_syntax_for_ranks_workers_and_servers(monkeypatch):
    """MARIANA_FAULT selects a process by rank, or by parameter-server role, and an event (step or push);
    only on the first attempt; a malformed entry is an error, not a silently skipped fault."""
    from mariana.platform.core import faults

    spec = "kill:rank=1:step=5,raise:step=3,hang:worker=1:step=15,kill:server=1:push=30"
    monkeypatch.setenv("MARIANA_FAULT", spec)
    monkeypatch.setattr(faults, "_roles", {})
    monkeypatch.setenv("RANK", "1")
    assert faults.FaultInjector().at == {5: "kill"}
    monkeypatch.setenv("RANK", "0")
    assert faults.FaultInjector().at == {3: "raise"}  # no WHO: rank 0
    monkeypatch.setenv("RANK", "3")
    faults.set_role("worker", 1)
    assert faults.FaultInjector().at == {15: "hang"} and faults.FaultInjector("push").at == {}
    monkeypatch.setenv("RANK", "1")
    faults.set_role("server", 1)
    assert faults.FaultInjector("push").at == {30: "kill"} and faults.FaultInjector().at == {5: "kill"}
    injector = faults.FaultInjector("push")
    injector.at[30] = "raise"
    with pytest.raises(ValueError, match="injected fault before push 30"):
        injector.maybe_fire(30)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert faults.FaultInjector().at == {}  # a restarted group runs clean
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    for bad in ("kil:rank=1:step=2", "kill:rank=1", "kill:rank=x:step=2", "kill:node=1:step=2"):
        monkeypatch.setenv("MARIANA_FAULT", bad)
        with pytest.raises(ValueError, match="MARIANA_FAULT entry"):
            faults.FaultInjector()


def test_watchdog_puts_its_host_in_the_store_at_once(monkeypatch):
    """A rank's first heartbeat, naming its host, is in the job's store as its watchdog starts, not a period
    (1 s) later: a host cut off in its first second of training is named by the others, not "?"
    (test_multihost_rdzv's cut-off test once saw "lost host ?")."""
    import faulthandler
    import signal
    import socket
    from datetime import timedelta

    import torch.distributed as dist
    from helpers import free_port
    from mariana.platform.runtime.watchdog import Watchdog

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    watchdog, key = Watchdog(rank=1, world_size=2, timeout_s=60.0), "mariana/hb/0/1"
    try:
        deadline = time.monotonic() + 0.5
        while not store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.check([key]), "no heartbeat within 0.5 s of the watchdog's start"
        beat = json.loads(store.get(key))
    finally:
        watchdog.stop()
        faulthandler.unregister(signal.SIGTERM)
    assert beat["host"] == socket.gethostname() and beat["phase"] == "init"


FORK_PROBE = """
import json, multiprocessing, os, sys, threading, time
from pathlib import Path
import torch
from mariana.platform.runtime.launch import fork_is_safe, fork_server

seen = {"fresh": fork_is_safe()}
t = threading.Thread(target=time.sleep, args=(0.5,))
t.start()
seen["with a thread"] = fork_is_safe()
t.join()
os.environ["OMP_NUM_THREADS"] = "1"  # what the launcher sets for its workers
with fork_server(Path(sys.argv[1])):
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    seen["a fork of this process"] = Path(f"/proc/{pid}/cmdline").read_bytes() == Path("/proc/self/cmdline").read_bytes()
    with multiprocessing.get_context("forkserver").Pool(1) as pool:
        seen["worker threads"] = pool.apply(torch.get_num_threads)
torch.ones(512, 512) @ torch.ones(512, 512)  # a parallel region: OpenMP's pool now exists
seen["right after a parallel region"] = fork_is_safe()  # its threads still spin
time.sleep(1)
seen["a second after"] = fork_is_safe()  # they wait in OpenMP's code
print(json.dumps(seen))
"""


def test_the_fork_server_is_a_fork_of_the_launcher_only_where_that_is_safe(tmp_path):
    """The launch's fork server forks the launcher (torch imported once) when nothing in it makes a fork
    unsafe, its workers then run the launch's OMP_NUM_THREADS (not the launcher's OpenMP setting); with
    another thread, or once OpenMP has run a parallel region (a forked child would hang in its first one),
    it is not a fork (multiprocessing starts a fresh interpreter)."""
    import subprocess
    import sys

    from helpers import ROOT, cli_env

    env = cli_env({"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"})  # the launcher's own: 2 threads
    p = subprocess.run([sys.executable, "-c", FORK_PROBE, str(tmp_path / "log")], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.splitlines()[-1]) == {
        "fresh": True,
        "with a thread": False,
        "a fork of this process": True,
        "worker threads": 1,
        "right after a parallel region": False,
        "a second after": False,
    }
