"""A preloaded interpreter per test process that forks each `helpers.run_cli` command (tests only).

A command run as ``python -m mariana.platform.cli`` spends seconds of CPU importing torch and the platform
before it does anything; the suite runs dozens. The zygote (this file run as a script, one per pytest
process) imports them once, then for each request forks a child that becomes the command: its files on
descriptors 0/1/2, its environment, working directory, ``sys.argv`` and OpenMP thread count, and
``mariana.platform.cli`` run as ``__main__``, ending the interpreter as ``python -m`` would (atexit
handlers, exit code, a crash's traceback on stderr). The child is a real process of its own, forked
from a single-threaded parent that never ran a torch operation (no OpenMP pool to inherit).

Protocol on the zygote's stdin/stdout, one JSON object per line: the request ``{"argv", "env", "cwd",
"out", "err"}`` (``out``/``err``: files for the command's stdout/stderr), then the replies ``{"pid"}``
(forked) and ``{"rc"}`` (its exit code as `subprocess` reports it: negative for a signal).

`run` is the client (`helpers.run_cli`); `fits` says when a fresh interpreter is needed instead: an
environment differing from the zygote's beyond ``MARIANA_*`` variables that nothing reads at import and
pytest's own (``PYTEST_CURRENT_TEST`` changes with every test).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CLI = "mariana.platform.cli"
PRELOAD = ["torch", "torch.distributed.run", "torch._dynamo", "mariana.platform.cli.main", "mariana.platform.ps.master",
           *(f"mariana.apps.{app}.train" for app in ("mlp", "pctr", "vision", "asr"))]  # fmt: skip
READ_AT_IMPORT = ("MARIANA_PS_MAX_MSG_MB",)  # product settings read when a module loads, not per command
_server: dict = {}  # this process's zygote: {"proc": Popen, "env": its environment}
_lock = threading.Lock()  # one command at a time: a thread finding it taken runs a fresh interpreter


def fits(env: dict[str, str], base: dict[str, str]) -> bool:
    """Whether a command with environment ``env`` may be a fork of a zygote started with ``base``."""
    keys = {k for k in env.keys() | base.keys() if env.get(k) != base.get(k)}
    return all(k.startswith(("MARIANA_", "PYTEST_")) and k not in READ_AT_IMPORT for k in keys)


def _start(env: dict[str, str], cwd: Path) -> dict:
    if (s := _server) and s["proc"].poll() is None:
        return s  # its environment stays: a request it does not fit runs fresh (a restart costs more)
    _stop()
    proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, cwd=cwd, text=True, bufsize=1)  # fmt: skip
    _server.update(proc=proc, env=env)
    return _server


def _stop() -> None:
    if proc := _server.pop("proc", None):
        proc.stdin.close()
        proc.wait(30)


atexit.register(_stop)


def _reply(proc: subprocess.Popen, deadline: float | None) -> dict:
    """The zygote's next reply line; TimeoutError past ``deadline`` (time.monotonic())."""
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    if not select.select([proc.stdout], [], [], wait)[0]:
        raise TimeoutError
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the test zygote ended (exit code {proc.wait()})")
    return json.loads(line)


def run(argv: list[str], env: dict[str, str], base: dict[str, str], cwd: Path, timeout: float):
    """``python -m mariana.platform.cli argv`` as a fork of this process's zygote (started with environment
    ``base`` on first use) -> a `subprocess.CompletedProcess` as `subprocess.run` would return it (text
    streams), or None where ``env`` does not fit the zygote's (`fits`), it may not fork, or another thread's
    command holds it; `subprocess.TimeoutExpired` past ``timeout`` seconds, the command killed."""
    if not _lock.acquire(blocking=False):
        return None
    try:
        server = _start(base, cwd)
        return _fork(server["proc"], argv, env, cwd, timeout) if fits(env, server["env"]) else None
    finally:
        _lock.release()


def _fork(proc: subprocess.Popen, argv: list[str], env: dict[str, str], cwd: Path, timeout: float):
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="zygote-") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        request = {"argv": argv, "env": env, "cwd": str(cwd), "out": str(out), "err": str(err)}
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        if (pid := _reply(proc, None)["pid"]) is None:
            return None
        try:
            rc = _reply(proc, deadline)["rc"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            _reply(proc, None)
            raise subprocess.TimeoutExpired([CLI, *argv], timeout, out.read_text(), err.read_text()) from None
        read = {p: p.read_text(errors="replace") if p.exists() else "" for p in (out, err)}
    return subprocess.CompletedProcess([sys.executable, "-m", CLI, *argv], rc, read[out], read[err])


def _become(request: dict, default_threads: int) -> None:
    """In the forked child: become ``python -m mariana.platform.cli argv`` (never returns normally)."""
    import runpy

    import torch

    fds = [os.open(os.devnull, os.O_RDONLY)]
    fds += [os.open(request[k], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for k in ("out", "err")]
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or default_threads))
    sys.argv, sys.path[0] = [CLI, *request["argv"]], os.getcwd()  # as ``python -m`` there
    runpy.run_module(CLI, run_name="__main__", alter_sys=True)
    sys.exit(0)


def serve() -> None:
    """The zygote: import what the commands import, then fork one child per request line on stdin (none where
    a fork is unsafe, e.g. once an import ran an OpenMP region: the reply then says so)."""
    import importlib

    sys.path[0] = os.getcwd()  # not tests/: what ``python -m`` in the repository root sees
    for name in PRELOAD:
        importlib.import_module(name)
    import torch
    from mariana.platform.runtime.launch import fork_is_safe

    threads = torch.get_num_threads()
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    for line in sys.stdin:
        request = json.loads(line)
        if not fork_is_safe():
            print(json.dumps({"pid": None}), file=replies)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if (pid := os.fork()) == 0:
            replies.close()
            _become(request, threads)
        print(json.dumps({"pid": pid}), file=replies)
        status = os.waitpid(pid, 0)[1]
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=replies)


if __name__ == "__main__":
    serve()
