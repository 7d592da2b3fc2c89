"""A preloaded interpreter per test process that forks each `helpers.run_cli` command (tests only).

A command run as ``python -m mariana.platform.cli`` spends seconds of CPU importing torch and the platform
before it does anything; the suite runs dozens. The zygote (this file run as a script, one per pytest
process) imports them once, then for each request forks a child that becomes the command: its files on
descriptors 0/1/2, its environment, working directory, ``sys.argv`` and OpenMP thread count, and
``mariana.platform.cli`` run as ``__main__``, ending the interpreter as ``python -m`` would (atexit
handlers, exit code, a crash's traceback on stderr). The child is a real process of its own, forked
from a single-threaded parent that never ran a torch operation (no OpenMP pool to inherit).

A request may instead be a torchrun launch of a test's worker script (``nproc`` > 0, `helpers.run_torchrun`):
the child runs torchrun's agent, whose workers are forks of a server forked from it (the platform's launcher).

Protocol on the zygote's stdin/stdout, one JSON object per line: the request ``{"argv", "nproc", "env",
"cwd", "out", "err", "timeout"}`` (``out``/``err``: files for the command's stdout/stderr), then the replies
``{"pid"}`` (forked) and ``{"rc", "timed_out"}`` (its exit code as `subprocess` reports it: negative for a
signal; the zygote kills a command past ``timeout`` seconds). A background request (`spawn`: a server the
test talks to) adds ``{"status", "session"}`` and gets the first reply only: the zygote reaps the command
when it ends (SIGCHLD) and writes its exit code to the file ``status``, which `Forked` reads.

`run` and `spawn` are the clients (`helpers.run_cli`, `helpers.start_cli`); `fits` says when a fresh
interpreter is needed instead: an environment differing from the zygote's beyond ``MARIANA_*`` variables
that nothing reads at import, pytest's own (``PYTEST_CURRENT_TEST`` changes with every test) and those torch
sets and reads per call.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

CLI = "mariana.platform.cli"
PRELOAD = ["torch", "torch.distributed.run", "torch._dynamo", "mariana.platform.cli.main", "mariana.platform.ps.master",
           *(f"mariana.apps.{app}.train" for app in ("mlp", "pctr", "vision", "asr"))]  # fmt: skip
READ_AT_IMPORT = ("MARIANA_PS_MAX_MSG_MB",)  # product settings read when a module loads, not per command
# Set in this process's os.environ by torch itself (inductor's first compile writes its default cache folder)
# and read per call: without it, every command after an in-process compile would need a fresh interpreter.
READ_PER_CALL = ("TORCHINDUCTOR_CACHE_DIR",)
_server: dict = {}  # this process's zygote: {"proc": Popen, "env": its environment}
_lock = threading.Lock()  # one command at a time: a thread finding it taken runs a fresh interpreter


def fits(env: dict[str, str], base: dict[str, str]) -> bool:
    """Whether a command with environment ``env`` may be a fork of a zygote started with ``base``."""
    keys = {k for k in env.keys() | base.keys() if env.get(k) != base.get(k)}
    return all(
        k.startswith(("MARIANA_", "PYTEST_")) and k not in READ_AT_IMPORT or k in READ_PER_CALL for k in keys
    )


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


def _reply(proc: subprocess.Popen) -> dict:
    """The zygote's next reply line (a blocking read: both replies may already sit in the stream's buffer,
    where a ``select`` on the pipe would not see the second)."""
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the test zygote ended (exit code {proc.wait()})")
    return json.loads(line)


def command(argv: list[str], nproc: int = 0) -> list[str]:
    """The fresh interpreter's command line a request stands for: the CLI, or torchrun with ``nproc`` workers."""
    launcher = ["torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc else [CLI]
    return [sys.executable, "-m", *launcher, *argv]


def run(
    argv: list[str], env: dict[str, str], base: dict[str, str], cwd: Path, timeout: float, nproc: int = 0
):
    """``python -m mariana.platform.cli argv`` as a fork of this process's zygote (started with environment
    ``base`` on first use) -> a `subprocess.CompletedProcess` as `subprocess.run` would return it (text
    streams), or None where ``env`` does not fit the zygote's (`fits`), it may not fork, or another thread's
    command holds it; `subprocess.TimeoutExpired` past ``timeout`` seconds, the command killed. With
    ``nproc``: ``torchrun --standalone --nproc-per-node nproc argv`` (a script and its arguments) instead."""
    if not _lock.acquire(blocking=False):
        return None
    try:
        server = _start(base, cwd)
        return _fork(server["proc"], argv, env, cwd, timeout, nproc) if fits(env, server["env"]) else None
    finally:
        _lock.release()


def spawn(argv: list[str], env: dict[str, str], base: dict[str, str], cwd: Path, log: Path):
    """``python -m mariana.platform.cli argv`` in the background as a fork of this process's zygote, in a
    session of its own, stdout and stderr appended to ``log`` -> a `Forked`, or None as `run` returns it."""
    if not _lock.acquire(blocking=False):
        return None
    try:
        server = _start(base, cwd)
        if not fits(env, server["env"]):
            return None
        status = Path(tempfile.mkdtemp(prefix="zygote-")) / "status"
        request = {"argv": argv, "nproc": 0, "env": env, "cwd": str(cwd), "out": str(log), "err": str(log),
                   "status": str(status), "session": True}  # fmt: skip
        server["proc"].stdin.write(json.dumps(request) + "\n")
        server["proc"].stdin.flush()
        pid = _reply(server["proc"])["pid"]
        return None if pid is None else Forked(pid, status, command(argv))
    finally:
        _lock.release()


class Forked:
    """A background command of the zygote (its child, not ours): what the tests use of `subprocess.Popen`."""

    def __init__(self, pid: int, status: Path, args: list[str]):
        self.pid, self.args, self.returncode, self._status = pid, args, None, status

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():  # written once the zygote has reaped it
            self.returncode = int(self._status.read_text())
            shutil.rmtree(self._status.parent, ignore_errors=True)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _fork(
    proc: subprocess.Popen, argv: list[str], env: dict[str, str], cwd: Path, timeout: float, nproc: int
):
    with tempfile.TemporaryDirectory(prefix="zygote-") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        files = {"out": str(out), "err": str(err)}
        request = {"argv": argv, "nproc": nproc, "env": env, "cwd": str(cwd), **files, "timeout": timeout}
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        if _reply(proc)["pid"] is None:
            return None
        done = _reply(proc)
        read = {p: p.read_text(errors="replace") if p.exists() else "" for p in (out, err)}
    if done["timed_out"]:
        raise subprocess.TimeoutExpired(command(argv, nproc), timeout, read[out], read[err])
    return subprocess.CompletedProcess(command(argv, nproc), done["rc"], read[out], read[err])


def _become(request: dict, default_threads: int) -> None:
    """In the forked child: become ``python -m mariana.platform.cli argv`` (never returns normally)."""
    import runpy

    import torch

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if request.get("session"):
        os.setsid()
    mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request.get("status") else os.O_TRUNC)
    fds = [os.open(os.devnull, os.O_RDONLY), os.open(request["out"], mode, 0o644)]
    fds.append(fds[1] if request["err"] == request["out"] else os.open(request["err"], mode, 0o644))
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        os.close(fd)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or default_threads))
    if request["nproc"]:
        _torchrun(request["argv"], request["nproc"])
    else:
        sys.argv, sys.path[0] = [CLI, *request["argv"]], os.getcwd()  # as ``python -m`` there
        runpy.run_module(CLI, run_name="__main__", alter_sys=True)
    sys.exit(0)


def _torchrun(argv: list[str], nproc: int) -> None:
    """In the forked child: ``torchrun --standalone --nproc-per-node nproc argv`` (``argv``: a script and its
    arguments) through the platform's launcher settings, the workers forked from a fork of this process."""
    from mariana.platform.runtime import launch
    from torch.distributed.launcher.api import elastic_launch

    config = launch.launch_config(nproc, types.SimpleNamespace(max_restarts=0))
    with tempfile.TemporaryDirectory(prefix="zygote-") as tmp, launch.fork_server(Path(tmp) / "launcher.log"):
        elastic_launch(config, entrypoint=_script)(*argv)


def _script(path: str, *args: str) -> None:
    """One torchrun worker: ``python path args`` (its folder first on ``sys.path``, as there)."""
    import runpy

    sys.argv = [path, *args]
    sys.path.insert(0, str(Path(path).resolve().parent))
    runpy.run_path(path, run_name="__main__")


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
    background: dict[int, str] = {}  # pid -> its status file
    signal.signal(signal.SIGCHLD, lambda *_: _reap(background))
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
        if request.get("status"):
            background[pid] = request["status"]
            _reap(background)  # it may have ended before it was in the list
        else:
            print(json.dumps(_wait(pid, request["timeout"])), file=replies)


def _reap(background: dict[int, str]) -> None:
    """Reap the background commands that ended, each exit code written to its status file (atomically)."""
    for pid in list(background):
        try:
            done, code = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped meanwhile by the handler, run between two of this loop's bytecodes
            continue
        if done and (status := background.pop(pid, None)):
            Path(status + ".tmp").write_text(str(os.waitstatus_to_exitcode(code)))
            os.replace(status + ".tmp", status)


def _wait(pid: int, timeout: float) -> dict:
    """Wait for the child ``pid`` at most ``timeout`` seconds (SIGKILL past it) -> ``{"rc", "timed_out"}``."""
    fd = os.pidfd_open(pid)
    try:
        timed_out = not select.select([fd], [], [], timeout)[0]
        if timed_out:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(fd)
    return {"rc": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), "timed_out": timed_out}


if __name__ == "__main__":
    serve()
