"""One multi-process test helper for all three frameworks: free loopback ports, a deterministic
environment, and the real launcher (``python -m mariana.platform.cli ...`` -> torchrun -> workers)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import zygote

ROOT = Path(__file__).resolve().parents[1]
USE_ZYGOTE = os.environ.get("MARIANA_TEST_ZYGOTE", "1") != "0"
DATA = Path(os.environ.get("MARIANA_DATA", ROOT.parent / "shared" / "data")).resolve()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a CLI subprocess of the tests runs with: one thread, unbuffered, no CUDA device (`cli_env`; also set
# around an in-process command, `trained_runs.as_subprocess`, for the processes it starts).
CHILD_ENV = {
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "CUDA_VISIBLE_DEVICES": "",
}


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a CLI subprocess: one thread per process, unbuffered, no stray torchrun vars."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MARIANA_FAULT"))}
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "GROUP_RANK",
    ):
        env.pop(k, None)
    env.update(CHILD_ENV)
    env.update(extra or {})
    return env


_base: dict[str, str] = {}  # `zygote_env`, once it is known


def zygote_env() -> dict[str, str]:
    """The environment the zygote starts with, and which a command's must fit to be a fork of it: `cli_env` as
    it was once every test module was imported (conftest.py's ``pytest_collection_finish``), not as one test's
    ``monkeypatch`` left it when the zygote happened to start."""
    return _base or cli_env()


def run_cli(
    args: list[str], timeout: float = 300, env: dict[str, str] | None = None, check: bool = False
) -> subprocess.CompletedProcess:
    """Run ``mariana <args>`` as a real process of its own from the repository root; returns its
    CompletedProcess (text stdout/stderr). ``check=True`` raises with both streams in the message on a
    non-zero exit. The process is a fork of this test process's preloaded interpreter (`zygote`) unless its
    environment needs a fresh one (or ``MARIANA_TEST_ZYGOTE=0``)."""
    argv, full_env, base = [str(a) for a in args], cli_env(env), zygote_env()
    proc = zygote.run(argv, full_env, base, ROOT, timeout) if USE_ZYGOTE else None
    if proc is None:
        proc = subprocess.run(
            zygote.command(argv), cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
        )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"mariana {' '.join(argv)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc


def start_cli(args: list, log: Path, env: dict[str, str] | None = None):
    """``mariana <args>`` started in the background (a server a test talks to) in a session of its own, its
    stdout and stderr appended to ``log`` -> a `subprocess.Popen`, or the zygote's `zygote.Forked` (what
    the tests use of one: ``pid``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``,
    ``returncode``)."""
    argv, full_env = [str(a) for a in args], cli_env(env)
    Path(log).touch()  # there to read from the start
    proc = zygote.spawn(argv, full_env, zygote_env(), ROOT, Path(log)) if USE_ZYGOTE else None
    if proc is None:
        with open(log, "ab") as f:
            proc = subprocess.Popen(zygote.command(argv), cwd=ROOT, env=full_env, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    return proc


def wait_for_line(proc, log: Path, text: str, timeout: float = 60) -> list[str]:
    """The whole lines of ``log`` up to the first that contains ``text``, that one last (``proc`` writes
    them: `start_cli`); AssertionError with the output if ``proc`` ends first or ``timeout`` seconds pass (its
    session killed, so a failed test leaves nothing running)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = Path(log).read_text().splitlines(keepends=True)
        lines = [ln.rstrip("\n") for ln in lines if ln.endswith("\n")]
        if (i := next((i for i, ln in enumerate(lines) if text in ln), None)) is not None:
            return lines[: i + 1]
        if proc.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(
                f"no line with {text!r} (exit code {proc.returncode}):\n" + "\n".join(lines[-20:])
            )
        time.sleep(0.05)


def run_torchrun(script: str | Path, nproc: int, *args, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``script`` (a test's worker entry) in ``nproc`` processes under the real launcher
    (``torchrun --standalone``: a free rendezvous port), from the repository root, in `cli_env`; asserts a
    zero exit with the tail of stderr in the message. The launcher is a fork of the test process's `zygote`
    and its workers forks of a server forked from it, unless the zygote is off."""
    argv, env = [str(script), *map(str, args)], cli_env()
    proc = zygote.run(argv, env, zygote_env(), ROOT, timeout, nproc) if USE_ZYGOTE else None
    if proc is None:
        cmd = zygote.command(argv, nproc)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def assert_cli_error(proc: subprocess.CompletedProcess, *fragments: str, code: int = 2) -> None:
    """A clean CLI failure: exit ``code``, every ``fragment`` in stderr, and no Python traceback anywhere."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, f"exit {proc.returncode}, expected {code}\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    for f in fragments:
        assert f in proc.stderr, f"{f!r} not in stderr:\n{proc.stderr[-4000:]}"
