"""Model servers the job service starts from its web UI: ``mariana serve --APP RUN`` for a job's exported
model, one process per job on a free loopback port, ended with the service."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ModelServers:
    """Job id -> (the ``mariana serve`` process, its URL); thread-safe (the API runs in a thread pool)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._procs: dict[int, tuple[subprocess.Popen, str]] = {}

    def url(self, job_id: int) -> str | None:
        """The URL of the job's model server while it runs, else None."""
        with self._lock:
            entry = self._procs.get(job_id)
        return entry[1] if entry and entry[0].poll() is None else None

    def start(self, job_id: int, app_flag: str, run_dir: str) -> dict:
        """Start ``mariana serve APP_FLAG RUN_DIR`` on a free port (its output to ``RUN_DIR/serve.log``), or
        return the running one -> ``{"url", "pid"}``."""
        with self._lock:
            if job_id in self._procs and self._procs[job_id][0].poll() is None:
                return {"url": self._procs[job_id][1], "pid": self._procs[job_id][0].pid}
            port = _free_port()
            with open(Path(run_dir) / "serve.log", "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "mariana.platform.cli", "serve", app_flag, run_dir,
                     "--host", "127.0.0.1", "--port", str(port)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            self._procs[job_id] = (proc, url)
        return {"url": url, "pid": proc.pid}

    def stop(self, job_id: int) -> dict | None:
        """SIGTERM the job's model server (SIGKILL after 10 s) and reap it -> ``{"stopped": url,
        "exit_code"}``, or None when it has none."""
        with self._lock:
            entry = self._procs.pop(job_id, None)
        if entry is None:
            return None
        proc, url = entry
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return {"stopped": url, "exit_code": proc.returncode}

    def close(self) -> None:
        """End every model server (when the service stops): SIGTERM all, then wait 10 s each, then SIGKILL."""
        with self._lock:
            procs = [proc for proc, _ in self._procs.values()]
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
