"""``--rdzv-endpoint HOST:PORT``, checked before torchrun is started: torchrun answers a malformed or
unreachable endpoint with a long traceback, or only after its rendezvous timeout (minutes).

`check_endpoint` (called by config validation): the form ``HOST:PORT`` with a port in 1..65535 and a
HOST that resolves. An endpoint on another machine must also accept a TCP connection within
``CONNECT_S`` seconds: that machine (the first node) hosts the rendezvous store, so nothing to connect to
means its job is not running. A loopback or own address is not connected to: this node hosts the store
there itself (torch's c10d rendezvous does the same test)."""

from __future__ import annotations

import ipaddress
import socket

from .errors import MarianaError

CONNECT_S = 5.0


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


def is_this_host(host: str) -> bool:
    """A loopback address, or one of this machine's own names or addresses."""
    addrs = _addresses(host)
    if any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        return True
    own = _addresses(socket.gethostname()) | _addresses(socket.getfqdn())
    return bool(addrs & own)


def check_endpoint(endpoint: str) -> None:
    """MarianaError (one line) for a malformed, unknown or (on another machine) unreachable endpoint."""
    host, port = split_endpoint(endpoint)
    if not _addresses(host):
        raise MarianaError(f"--rdzv-endpoint {endpoint}: unknown host {host!r}")
    if is_this_host(host):
        return
    try:
        socket.create_connection((host, port), timeout=CONNECT_S).close()
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise MarianaError(
            f"--rdzv-endpoint {endpoint}: cannot connect ({why}); the first node's job, which hosts the "
            "rendezvous there, must be running"
        ) from None
