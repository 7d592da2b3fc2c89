"""``--rdzv-endpoint HOST:PORT``, checked before torchrun is started: torchrun answers a malformed or
unreachable endpoint with a long traceback, or only after its rendezvous timeout (minutes).

`check_endpoint` (called by config validation): the form ``HOST:PORT`` with a port in 1..65535 and a
HOST that resolves. An endpoint on another machine must also accept a TCP connection: that machine (the
first node) hosts the rendezvous store. Cluster launchers (srun, pdsh) start every node at once, so a
refused or timed-out connection is retried for `wait_s` seconds (``MARIANA_RDZV_WAIT``, default 120; 0:
one try), announced by one line, and the endpoint refused only then. A loopback address or one of this
machine's (any interface's: one it can bind) is not connected to: this node hosts the store there."""

from __future__ import annotations

import os
import socket
import sys
import time

from .errors import MarianaError

CONNECT_S = 5.0
WAIT_ENV = "MARIANA_RDZV_WAIT"


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); MarianaError for anything else."""
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise MarianaError(
            f"--rdzv-endpoint {endpoint}: expected HOST:PORT with a port number 1-65535 (e.g. node0:29500)"
        )
    return host, int(port)


def _addresses(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (socket.gaierror, UnicodeError):
        return set()


def _bindable(addr: str) -> bool:
    """True when ``addr`` is an address of one of this machine's interfaces (loopback included)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def is_this_host(host: str) -> bool:
    """``host`` names (or is) an address of this machine: loopback, or any interface's."""
    return any(_bindable(a) for a in _addresses(host))


def wait_s() -> float:
    """How long a node waits for the first node's store (``MARIANA_RDZV_WAIT`` seconds, default 120)."""
    value = os.environ.get(WAIT_ENV, "120")
    try:
        return max(0.0, float(value))
    except ValueError:
        raise MarianaError(f"{WAIT_ENV}={value!r}: expected a number of seconds") from None


def _connect_error(host: str, port: int) -> str | None:
    try:
        socket.create_connection((host, port), timeout=CONNECT_S).close()
    except OSError as e:
        return "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
    return None


def check_endpoint(endpoint: str) -> None:
    """MarianaError (one line) for a malformed, unknown or (on another machine) unreachable endpoint;
    an endpoint that does not answer yet is waited for (see the module docstring)."""
    host, port = split_endpoint(endpoint)
    if not _addresses(host):
        raise MarianaError(f"--rdzv-endpoint {endpoint}: unknown host {host!r}")
    if is_this_host(host):
        return
    why, limit = _connect_error(host, port), wait_s()
    if why and limit > 0:
        print(f"mariana: waiting up to {limit:g} s for the rendezvous at {endpoint} (the first node's job: "
              f"{why})", file=sys.stderr, flush=True)  # fmt: skip
        deadline = time.monotonic() + limit
        while why and time.monotonic() < deadline:
            time.sleep(0.5)
            why = _connect_error(host, port)
    if why:
        waited = f" for {limit:g} s" if limit > 0 else ""
        raise MarianaError(
            f"--rdzv-endpoint {endpoint}: cannot connect{waited} ({why}); the first node's job, which hosts "
            f"the rendezvous there, must be running (set {WAIT_ENV}=SECONDS to wait longer)"
        )
