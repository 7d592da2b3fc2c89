"""`helpers.run_cli` forks its commands from a preloaded interpreter (`zygote`): the test gets back what a
fresh ``python -m mariana.platform.cli`` gives (exit code, stdout, stderr), a command past its timeout is
killed, and an environment a fork cannot take gets a fresh interpreter; `helpers.start_cli`'s background
commands are forks too."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import helpers
import pytest
import zygote
from helpers import DATA, ROOT, cli_env, run_cli
from mariana.platform.runtime.launch import descendants

FRAPPE = DATA / "frappe" / "frappe.validation.libfm"


@pytest.fixture(autouse=True)
def forked(monkeypatch):
    monkeypatch.setattr(helpers, "USE_ZYGOTE", True)  # also under MARIANA_TEST_ZYGOTE=0


def train(out, steps: int) -> list:
    return [
        "mlp",
        "train",
        "--data",
        FRAPPE,
        "--out",
        out,
        "--preset",
        "debug",
        "--no-progress",
        "--max-steps",
        steps,
    ]


def fresh(argv: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mariana.platform.cli", *argv]
    return subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case", ["version", "bad input"])
def test_a_forked_command_answers_as_a_fresh_interpreter(case, tmp_path):
    argv = (
        ["--version"]
        if case == "version"
        else ["mlp", "train", "--data", str(tmp_path / "none"), "--out", "x"]
    )
    forked, new = run_cli(argv), fresh(argv)
    assert zygote._server["proc"].poll() is None  # the command was a fork of the zygote
    assert (forked.returncode, forked.stdout, forked.stderr) == (new.returncode, new.stdout, new.stderr)


def test_a_command_past_its_timeout_is_killed(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli(train(tmp_path / "run", 10_000_000), timeout=2)
    assert descendants(zygote._server["proc"].pid) == []


def test_both_replies_in_the_pipe_before_the_first_is_read(monkeypatch):
    """A short command may end before the test process reads the fork's first reply: the second reply then
    already sits in the stream's buffer and must be read from there, not waited for until the timeout."""
    run_cli(["--version"])  # the zygote is up
    reply = zygote._reply

    def late(*args):
        if not late.slept:  # before the first reply only (a busy test process): the command ends meanwhile
            late.slept = time.sleep(3) or True
        return reply(*args)

    late.slept = False

    monkeypatch.setattr(zygote, "_reply", late)
    start = time.monotonic()
    assert run_cli(["--version"], timeout=30).returncode == 0
    assert time.monotonic() - start < 20


def test_what_a_fork_cannot_take_runs_fresh():
    base = cli_env()
    assert zygote.fits({**base, "MARIANA_JOBS_URL": "http://127.0.0.1:1"}, base)
    assert zygote.fits({**base, "PYTEST_CURRENT_TEST": "another test"}, base)
    assert zygote.fits({**base, "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_x"}, base)  # after a compile
    assert not zygote.fits({**base, "MARIANA_PS_MAX_MSG_MB": "1"}, base)  # read when its module loads
    assert not zygote.fits({**base, "OMP_NUM_THREADS": "2"}, base)
    assert not zygote.fits({k: v for k, v in base.items() if k != "PYTHONUNBUFFERED"}, base)


def test_a_command_from_another_thread_meanwhile_runs_fresh(tmp_path):
    """One command at a time goes through the zygote; another thread's, meanwhile, runs in a fresh interpreter
    (both through the zygote, each would read the other's replies)."""
    results: dict[str, subprocess.CompletedProcess] = {"first": run_cli(["--version"])}  # the zygote is up
    argv = train(tmp_path / "run", 2000)  # outlasts a fresh interpreter's --version
    thread = threading.Thread(target=lambda: results.update(train=run_cli(argv, timeout=120)))
    thread.start()
    deadline = time.monotonic() + 60
    while not zygote._lock.locked() and time.monotonic() < deadline:
        time.sleep(0.01)
    results["version"] = run_cli(["--version"], timeout=120)
    assert thread.is_alive()  # the version did not wait for the training's end
    thread.join(150)
    assert results["train"].returncode == 0 and "validation AUC" in results["train"].stdout, results["train"]
    assert (results["version"].returncode, results["version"].stdout) == (0, fresh(["--version"]).stdout)


def test_a_background_command_is_a_forked_session_reaped_by_the_zygote(tmp_path):
    """`helpers.start_cli`: a server forked by the zygote, in a session of its own, its output in the log; the
    zygote reaps it and records its exit code (a signal's negative, an error's 2) for `poll` and `wait`, while
    foreground commands go on meanwhile."""
    log = tmp_path / "service.log"
    proc = helpers.start_cli(["jobs", "serve", "--home", tmp_path / "home", "--port", "0"], log)
    try:
        assert isinstance(proc, zygote.Forked)
        lines = helpers.wait_for_line(proc, log, "http://", timeout=120)
        parent = int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert parent == zygote._server["proc"].pid and os.getsid(proc.pid) == proc.pid, lines
        assert (
            run_cli(["--version"]).returncode == 0 and proc.poll() is None
        )  # a foreground command meanwhile
    finally:
        proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL and proc.poll() == -signal.SIGKILL
    bad = helpers.start_cli(
        ["jobs", "serve", "--home", tmp_path / "home", "--port", "-5"], tmp_path / "bad.log"
    )
    assert bad.wait(60) == 2, (tmp_path / "bad.log").read_text()
    assert "--port" in (tmp_path / "bad.log").read_text()
