"""Shared pieces of the serving tests (no tests here): start a real ``mariana serve`` subprocess on a free
loopback port and talk HTTP to it. The models they serve are the shared trained runs of
`trained_runs` (``frappe_deepfm``, ``frappe_fm``, ``criteo_dcn``: built once per worker)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from helpers import DATA, free_port, start_cli

FRAPPE = DATA / "frappe" / "frappe.validation.libfm"
CRITEO = DATA / "criteo" / "criteo_sample.tsv"


def strip_label(line: str, fmt: str) -> str:
    """A training record without its label, as clients send it."""
    if fmt == "criteo":
        return line.rstrip("\r\n").split("\t", 1)[1]
    return line.split(None, 1)[1].strip()


def head_lines(path: Path, n: int) -> list[str]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(line.rstrip("\r\n"))
            if len(out) == n:
                break
    return out


class Server:
    """``python -m mariana.platform.cli serve ...`` on a free 127.0.0.1 port; stopped by `stop()`."""

    def __init__(self, args: list, log_dir: Path, startup_timeout: float = 90.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / f"serve-{self.port}.log", "w+")
        self.proc = start_cli(["serve", *args, "--port", self.port], Path(self.log.name))
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"server did not come up in {startup_timeout}s:\n{self.output()}")
            time.sleep(0.2)
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-6000:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def predict(self, instances, **kw) -> httpx.Response:
        return self.client.post("/v1/pctr/predict", json={"instances": instances}, **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # uvicorn shuts down gracefully on SIGTERM
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if hasattr(self, "client"):
            self.client.close()
        self.log.close()


def serve(args: list, tmp_path_factory) -> Server:
    log_dir = tmp_path_factory.mktemp("serve-logs")
    return Server([*args, "--threads", "1"], log_dir)


def parse_prometheus(text: str) -> dict[str, float]:
    """``{'name{labels}': value}`` for every sample line; asserts the exposition syntax is sane."""
    samples = {}
    for ln in text.splitlines():
        if not ln or ln.startswith("#"):
            assert ln == "" or ln.startswith(("# HELP ", "# TYPE ")), ln
            continue
        key, _, value = ln.rpartition(" ")
        assert key, ln
        samples[key] = float(value)
    return samples


def pctr_probs(resp: httpx.Response) -> list:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) >= {"probabilities", "errors", "model_version"}, body
    return body["probabilities"]


@pytest.fixture(scope="session")
def no_proxy_env():
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
    return json
