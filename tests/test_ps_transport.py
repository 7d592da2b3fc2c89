"""The parameter servers' transport (platform/ps/transport.py, ZeroMQ): no ``torch.distributed.rpc`` left in
the product, calls carry tensors without copies, and what a network service needs: a peer without the
job's secret or of another protocol version is refused, an over-size message never reaches the served
object, and a killed server is detected within the stated time instead of waited on."""

from __future__ import annotations

import ast
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from mariana.platform.ps import transport
from mariana.platform.ps.transport import PROTOCOL, Client, Handle, Server, TransportError

ROOT = Path(__file__).resolve().parents[1]
SECRET = b"s3cret-of-this-job"


def rpc_uses(root: Path) -> list[str]:
    """``file:line`` of every import or attribute use of ``torch.distributed.rpc`` under the product."""
    found = []
    for folder in ("platform", "apps", "serving"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Attribute) and node.attr == "rpc":
                    names = [ast.unparse(node)]
                if any(n.startswith("torch.distributed.rpc") or n.endswith("dist.rpc") for n in names):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_torch_distributed_rpc_in_the_product():
    assert rpc_uses(ROOT) == []


class Store:
    """A served object: counts the rows pushed to it."""

    def __init__(self):
        self.pushed = 0

    def push(self, rows: torch.Tensor, grad: torch.Tensor) -> tuple:
        self.pushed += rows.numel()
        return rows * 2, grad.sum(0)


@pytest.fixture
def served():
    store = Store()
    server = Server({"ps": store}, SECRET)
    yield server, store
    server.close()


def test_a_call_carries_tensors_both_ways_and_sends_them_uncopied(served):
    server, store = served
    client = Client([server.address], SECRET, timeout_s=30)
    rows, grad = torch.arange(40_000), torch.randn(40_000, 17)
    doubled, total = Handle(client, 0).rpc_sync().push(rows, grad)
    assert torch.equal(doubled, rows * 2) and torch.allclose(total, grad.sum(0))
    assert store.pushed == 40_000
    frames = transport.encode((rows, grad))  # the tensors' own memory is what goes on the wire
    addrs = {np.frombuffer(f, np.uint8).ctypes.data for f in frames[1:]}
    assert addrs == {rows.data_ptr(), grad.data_ptr()}
    client.close()


def test_a_peer_without_the_jobs_secret_is_refused_and_cannot_push(served):
    server, store = served
    with pytest.raises(TransportError, match="refused: wrong job secret"):
        Client([server.address], b"guessed", timeout_s=30)
    raw = zmq.Context.instance().socket(zmq.DEALER)  # a stray process that skips the hello
    raw.connect(f"tcp://{server.address}")
    raw.send_multipart([b"C", b"1", *transport.encode(("ps", "push", (torch.ones(3), torch.ones(3, 2))))])
    assert raw.poll(10_000)
    kind, _, *reply = raw.recv_multipart(copy=False)
    assert transport.decode(reply) == ("err", "refused: no hello with the job's secret")
    assert store.pushed == 0
    raw.close(0)


def test_a_peer_of_another_protocol_version_is_refused(served):
    server, _ = served
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(f"tcp://{server.address}")
    raw.send_multipart([b"H", b"1", pickle.dumps((PROTOCOL + 1, SECRET))])
    assert raw.poll(10_000)
    _, _, *reply = raw.recv_multipart(copy=False)
    status, why = transport.decode(reply)
    assert (
        status == "err" and f"protocol version {PROTOCOL + 1}, this server speaks version {PROTOCOL}" in why
    )
    raw.close(0)


def test_a_message_over_the_size_limit_never_reaches_the_object(monkeypatch):
    monkeypatch.setattr(transport, "MAX_MSG_BYTES", 1 << 20)  # 1 MiB
    store = Store()
    server = Server({"ps": store}, SECRET)
    client = Client([server.address], SECRET, timeout_s=30)
    h = Handle(client, 0)
    h.rpc_sync().push(torch.arange(10), torch.ones(10, 2))  # under the limit: served
    big = h.rpc_async(timeout=2).push(torch.arange(10), torch.ones(1 << 19, 1))  # 2 MiB
    with pytest.raises(TimeoutError):
        big.wait()
    assert store.pushed == 10
    client.close()
    server.close()


SERVE = """
import sys, time
from mariana.platform.ps.transport import Server
class Slow:
    def sleep(self, s):
        time.sleep(s)
server = Server({"ps": Slow()}, sys.argv[1].encode())
print(server.address, flush=True)
time.sleep(600)
"""


def test_a_killed_server_is_detected_within_the_peer_timeout(monkeypatch):
    monkeypatch.setenv("MARIANA_PS_PEER_TIMEOUT_S", "2")
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, SECRET.decode()], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    try:
        client = Client([proc.stdout.readline().strip()], SECRET, timeout_s=60)
        waiting = Handle(client, 0).rpc_async(timeout=0).sleep(600)  # no call timeout: only heartbeats
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="sent nothing for 2 s: lost"):
            waiting.wait()
        assert time.monotonic() - t0 < 2 + 2  # the stated time, plus a heartbeat tick on a loaded machine
        with pytest.raises(TransportError, match="lost"):  # later calls fail at once
            Handle(client, 0).rpc_sync().sleep(0)
        client.close()
    finally:
        proc.kill()
        proc.wait()


def test_received_tensors_are_64_byte_aligned_like_torch_allocations():
    """libzmq hands out frames at any offset; a tensor decoded at one makes BLAS round differently (a
    bulk-synchronous stream then no longer equals one process), so decode moves it to a 64-byte boundary."""
    t = torch.randn(1000, 17)
    header, data = transport.encode(t)
    buf = np.zeros(len(data) + 64, np.uint8)
    off = next(o for o in range(1, 64) if (buf.ctypes.data + o) % 64)  # a misaligned place
    buf[off : off + len(data)] = np.frombuffer(data, np.uint8)
    got = transport.decode([zmq.Frame(header), zmq.Frame(buf[off : off + len(data)])])
    assert got.data_ptr() % 64 == 0 and torch.equal(got, t)
