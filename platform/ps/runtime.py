"""Roles and transport set-up of a parameter-server job launched by torchrun.

World layout: ranks ``0..S-1`` are the servers ``ps0..ps{S-1}``; ranks ``S..S+W-1`` are the workers
``worker0..worker{W-1}``. Each server serves on its own port (`transport.Server`, bound to `ps_host`) and
announces ``host:port`` in torchrun's agent store under a key of this formation of the group (a restarted
group never reads a dead one's addresses); rank 0 puts the job's secret there too (`ps_session`).

Several hosts: the same command on every host (platform/README.md, "Multi-node"; nproc-per-node x nnodes
= S + W); ranks, hence roles, are assigned by the rendezvous.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import TCPStore

from ..core.errors import MarianaError
from ..core.faults import set_role
from ..runtime.watchdog import exit_lost
from .transport import Client, Handle, Server, peer_timeout_s

log = logging.getLogger("mariana")


@dataclass
class Role:
    kind: str  # "server" | "worker"
    index: int
    rank: int
    world: int
    num_servers: int
    num_workers: int
    attempt: int

    @property
    def name(self) -> str:
        return f"ps{self.index}" if self.kind == "server" else f"worker{self.index}"


def role_from_env(num_servers: int, num_workers: int) -> Role:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != num_servers + num_workers:
        raise MarianaError(
            f"the job has {world} processes but --servers {num_servers} + --workers {num_workers} "
            f"= {num_servers + num_workers}"
        )
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank < num_servers:
        role = Role("server", rank, rank, world, num_servers, num_workers, attempt)
    else:
        role = Role("worker", rank - num_servers, rank, world, num_servers, num_workers, attempt)
    set_role(role.kind, role.index)  # MARIANA_FAULT may name it as server=S / worker=W
    return role


HOST_ENV = "MARIANA_PS_HOST"  # the address servers bind and announce (a machine with several interfaces)


def ps_host() -> str:
    """Where this process's server listens: ``MARIANA_PS_HOST`` if set (one of this machine's addresses:
    the interface the other hosts reach), else loopback when the whole job runs on this machine, else the
    address this machine reaches the rendezvous host from."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) >= int(os.environ.get("WORLD_SIZE", "1")):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), 9))  # no packet is sent: picks the route
        return s.getsockname()[0]


def _store(role: Role, timeout_s: float) -> tuple[TCPStore, str]:
    """(the rendezvous store, this group formation's key prefix): torchrun's agent store, whose keys
    outlive a restart of the group, so every formation gets its own prefix; outside torchrun a store on
    MASTER_ADDR:MASTER_PORT hosted by rank 0."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return TCPStore(addr, port, role.world, role.rank == 0, timeout, wait_for_workers=False), "mariana/ps"
    agent = TCPStore(addr, port, is_master=False, timeout=timeout, wait_for_workers=False)
    return (
        agent,
        f"mariana/ps/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{_generation(agent, role, timeout_s)}",
    )


def _generation(agent, role: Role, timeout_s: float) -> int:
    """The number of this formation of the group, the same on every rank.

    Not ``TORCHELASTIC_RESTART_COUNT``: with several torchrun agents (one per node or Slurm task) only the
    agent whose worker failed counts a restart; the others restart their workers for the membership change
    with their count unchanged, so the ranks of one group would disagree. Instead rank 0 of each new group
    bumps a counter in the agent store, and every other rank waits until the counter passes the generation
    it (its rank) joined last time, then joins that one."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    counter, seen = f"mariana/ps/generation/{run}", f"mariana/ps/joined/{run}/{role.rank}"
    last = int(agent.get(seen)) if agent.check([seen]) else 0
    if role.rank == 0:
        gen = agent.add(counter, 1)
    else:
        deadline = time.monotonic() + timeout_s
        while (gen := agent.add(counter, 0)) <= last:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {role.rank}: no new parameter-server group formed in {timeout_s:.0f} s"
                )
            time.sleep(0.05)
    agent.set(seen, str(gen))
    return gen


_SESSION: dict = {}  # this process's transport: "client" (made at first use), "store", "prefix", ...


@contextmanager
def ps_session(role: Role, timeout_s: float = 300.0, threads: int = 16, objects: dict | None = None):
    """Join the job's transport: a server serves ``objects`` (name -> object, e.g. ``{"ps": server}``)
    with ``threads`` calls at once and announces its address in the rendezvous store; every process can
    then reach the servers (`remote`). The job's secret: made by rank 0, handed out through the store.
    Yields this process's `transport.Server` (None on a worker)."""
    store, prefix = _store(role, timeout_s)
    if role.rank == 0:
        store.set(f"{prefix}/secret", secrets.token_hex(32))
    secret = store.get(f"{prefix}/secret")
    server, host = None, socket.gethostname()
    if role.kind == "server":
        server = Server(objects or {}, secret, ps_host(), threads, on_lost=lambda h, who: _lost(role, h, who))
        store.set(f"{prefix}/server/{role.index}", f"{server.address} {host}")
        log.info("server %d serves at %s on host %s", role.index, server.address, host)
    _SESSION.update(store=store, prefix=prefix, secret=secret, servers=role.num_servers, timeout=timeout_s,
                    role=role, who=(host, f"{role.kind} {role.index}"))  # fmt: skip
    try:
        yield server
    finally:
        client = _SESSION.pop("client", None)
        if client is not None:
            client.close()
        if server is not None:
            server.close()
        _SESSION.clear()


def remote(server: int, name: str = "ps") -> Handle:
    """The object server ``server`` serves as ``name`` (in a `ps_session`): ``.rpc_async().method(...)``."""
    if "client" not in _SESSION:
        s = _SESSION
        addrs, hosts = zip(
            *(s["store"].get(f"{s['prefix']}/server/{i}").decode().split() for i in range(s["servers"]))
        )
        s["client"] = Client(list(addrs), s["secret"], s["timeout"], s["who"], list(hosts),
                             on_lost=lambda h, who, role=s["role"]: _lost(role, h, who))  # fmt: skip
    return Handle(_SESSION["client"], server, name)


def _lost(role: Role, host: str, who: str) -> None:
    """A peer on another host silent for the peer timeout: its host is lost, this node's job ends naming it
    (`watchdog.exit_lost`). A peer on this host is torchrun's to watch (its calls fail: `TransportError`)."""
    if host not in ("?", socket.gethostname()):
        exit_lost(role.rank, f"lost host {host} ({who}): no heartbeat for {peer_timeout_s():.0f} s")
