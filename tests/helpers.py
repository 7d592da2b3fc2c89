"""One multi-process test helper for all three frameworks: free loopback ports, a deterministic
environment, and the real launcher (``python -m mariana.platform.cli ...`` -> torchrun -> workers)."""

from __future__ import annotations

import os
import socket
import subprocess
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


def run_cli(
    args: list[str], timeout: float = 300, env: dict[str, str] | None = None, check: bool = False
) -> subprocess.CompletedProcess:
    """Run ``mariana <args>`` as a real process of its own from the repository root; returns its
    CompletedProcess (text stdout/stderr). ``check=True`` raises with both streams in the message on a
    non-zero exit. The process is a fork of this test process's preloaded interpreter (`zygote`) unless its
    environment needs a fresh one (or ``MARIANA_TEST_ZYGOTE=0``)."""
    argv, full_env, base = [str(a) for a in args], cli_env(env), cli_env()
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


def run_torchrun(script: str | Path, nproc: int, *args, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``script`` (a test's worker entry) in ``nproc`` processes under the real launcher
    (``torchrun --standalone``: a free rendezvous port), from the repository root, in `cli_env`; asserts a
    zero exit with the tail of stderr in the message. The launcher is a fork of the test process's `zygote`
    and its workers forks of a server forked from it, unless the zygote is off."""
    argv, env = [str(script), *map(str, args)], cli_env()
    proc = zygote.run(argv, env, env, ROOT, timeout, nproc) if USE_ZYGOTE else None
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
