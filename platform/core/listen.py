"""Where ``mariana serve`` and ``mariana jobs serve`` listen: the hosts that are this machine, the rule that
binding any other host needs a token, and the bound socket."""

from __future__ import annotations

import socket

from .errors import MarianaError

LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})  # as a --host, or as a request's client address


def check_host(host: str, token: str | None, who_presents: str) -> None:
    """MarianaError unless ``host`` is loopback or there is a token (which ``who_presents`` must present)."""
    if host not in LOOPBACK and not token:
        raise MarianaError(
            f"--host {host} is reachable from other machines: give --token-file FILE (a secret that "
            f"{who_presents} must present), or bind 127.0.0.1"
        )


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: any free port); a port in use or an address that is not
    this machine's is a one-line MarianaError."""
    # proto IPPROTO_TCP, as asyncio's own listening sockets: asyncio sets TCP_NODELAY only on accepted
    # sockets of that proto, and without it small responses wait for the client's delayed ACK (Nagle)
    sock = socket.socket(
        socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise MarianaError(f"--host {host} --port {port}: cannot bind ({e.strerror or e})") from None
    return sock
