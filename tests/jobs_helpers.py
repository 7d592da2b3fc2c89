"""Helpers of the job-service and tuning tests: a real ``mariana jobs serve`` subprocess, small polling
utilities, and `run_in_process` for client commands that need no interpreter of their own."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from unittest import mock

import httpx
from cliwalk import cli
from helpers import cli_env, start_cli, wait_for_line


class Service:
    """``mariana jobs serve --home HOME --port 0 ...`` as a real process; ``url`` is what it printed."""

    def __init__(self, home: Path, *extra: str, slots: int = 2):
        self.home = Path(home)
        fd, log = tempfile.mkstemp(prefix=f"{self.home.name}-service-", suffix=".log", dir=self.home.parent)
        os.close(fd)
        self.log = Path(log)  # one file per start: a restarted service's URL is its own
        self.proc = start_cli(
            ["jobs", "serve", "--home", home, "--port", "0", "--slots", slots, *extra], self.log
        )
        self.url = (
            "http://" + wait_for_line(self.proc, self.log, "http://", 120)[-1].split("http://")[1].split()[0]
        )
        self.http = httpx.Client(base_url=self.url, timeout=30, trust_env=False)
        wait_for(lambda: self.http.get("/healthz").status_code == 200, 60, "service healthy")

    def output(self) -> str:
        """What the service printed so far (stdout and stderr)."""
        return self.log.read_text()

    def env(self) -> dict[str, str]:
        return {"MARIANA_JOBS_URL": self.url}

    def job(self, job_id: int) -> dict:
        return self.http.get(f"/api/jobs/{job_id}").raise_for_status().json()

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        """Stop the service and every job process it left running (tests must not leak processes)."""
        pids = []
        try:
            pids = [j["pid"] for j in self.http.get("/api/jobs").json()["jobs"] if j["state"] == "running"]
        except (httpx.HTTPError, ValueError):
            pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for pid in pids:
            if pid:
                kill_tree(pid)


def kill_tree(pid: int) -> None:
    from mariana.platform.runtime.launch import descendants

    for p, _ in [(pid, 0), *descendants(pid)]:
        try:
            os.killpg(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def wait_for(cond, timeout: float, what: str, interval: float = 0.3):
    """Poll ``cond()`` until it returns something truthy; that value, or AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = cond()
        except (httpx.HTTPError, KeyError, FileNotFoundError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for: {what}")
        time.sleep(interval)


def run_in_process(argv: list, capsys, env: dict[str, str] | None = None, check: bool = False):
    """``mariana ARGV`` in this process (`cliwalk.run_main`), with the environment `helpers.run_cli` gives a
    CLI process (`cli_env(env)`: one thread per process, no CUDA, no torchrun variables) for the call, so
    processes it starts (trials) get it too; os.environ is put back after. Returns a CompletedProcess as
    `run_cli` does (exit code, stdout, stderr); ``check=True`` raises with both streams on a non-zero exit.
    No interpreter start-up per command: the commands under test are the same code either way."""
    with mock.patch.dict(os.environ, cli_env(env), clear=True):
        return cli(argv, capsys, check)
