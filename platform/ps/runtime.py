"""Roles and RPC set-up of a parameter-server job launched by torchrun.

World layout: ranks ``0..S-1`` are the servers ``ps0..ps{S-1}``; ranks ``S..S+W-1`` are the workers
``worker0..worker{W-1}``. All join one TensorPipe RPC group. torchrun's agent store (MASTER_ADDR:MASTER_PORT)
outlives a restart of the group and its keys are not prefixed by attempt, so a restarted group that
rendezvoused through it (``env://``) would read the dead group's addresses. Instead rank 0 opens a fresh
store on a free port for each attempt and publishes the port in the agent store under a per-attempt key.

Several hosts: start the same command on every host with torchrun's multi-node flags, e.g. on each of two
hosts ``torchrun --nnodes 2 --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST0:29400
--rdzv-id job1 -m mariana.platform.cli pctr train ... --servers S --workers W --nnodes 2
--rdzv-endpoint HOST0:29400`` (N x 2 = S + W); ranks, hence roles, are assigned by the rendezvous.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import TCPStore, rpc

from ..core.errors import MarianaError
from ..core.faults import set_role


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


_STORE = None  # rank 0's per-attempt rendezvous store; must outlive the RPC session


def rpc_init_method(role: Role, timeout_s: float = 300.0) -> str:
    """A rendezvous URL private to this attempt of the group (``env://`` outside torchrun).

    Inside torchrun every rank connects to rendezvous stores as a client (TORCHELASTIC_USE_AGENT_STORE),
    so rank 0 hosts the fresh store itself (on a port the OS picks) before anyone connects."""
    global _STORE
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in os.environ:
        return "env://"
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=timeout_s)
    agent = TCPStore(addr, port, is_master=False, timeout=timeout, wait_for_workers=False)
    gen = _generation(agent, role, timeout_s)
    key = f"mariana/ps/rpc_port/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{gen}"
    if role.rank == 0:
        _STORE = TCPStore("0.0.0.0", 0, is_master=True, timeout=timeout, wait_for_workers=False)
        agent.set(key, str(_STORE.port))
    return f"tcp://{addr}:{int(agent.get(key))}"


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


@contextmanager
def rpc_session(role: Role, timeout_s: float = 300.0, threads: int = 16):
    """``init_rpc`` for this role; always shuts RPC down (gracefully = a barrier over the group on success,
    at once on an exception, so a failing process does not wait for peers that may be gone)."""
    opts = rpc.TensorPipeRpcBackendOptions(
        init_method=rpc_init_method(role, timeout_s), rpc_timeout=timeout_s, num_worker_threads=threads
    )
    rpc.init_rpc(role.name, rank=role.rank, world_size=role.world, rpc_backend_options=opts)
    ok = False
    try:
        yield
        ok = True
    finally:
        rpc.shutdown(graceful=ok)
