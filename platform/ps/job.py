"""Start-up of the processes of a parameter-server job (torchrun, one process per server or worker):
the role and run directory (`start_process`), a server's shard and dense slice (`build_server`), serving
until told to finish (`serve`), the full model assembled from the servers (`assemble_model`), and the
announcements of one worker to all that server 0 keeps for a stream (`Coordinator`, reached through the
transport: ``runtime.remote(0, "coordinator")``, ``handle.rpc_sync(timeout=0).fetch(seq, worker)``).

The application supplies its model (`protocol.SparseModel`) and a function that builds a full model around
a given table; nothing here knows the application.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from ..core.rundir import RunDir, setup_logging
from ..sparse.rules import RowOptConfig, keep_freed_memory
from .dense import DenseStore, flatten, unflatten_into
from .protocol import TABLE, KeyMap, SparseModel
from .runtime import Role, ps_session, role_from_env
from .server import ParamServer
from .shard import EmbeddingShard, TableSpec, contiguous_part

log = logging.getLogger("mariana")


def start_process(num_servers: int, num_workers: int, out: str | Path) -> tuple[Role, RunDir]:
    """What every process of a job does first: its role (from RANK), the run directory with this rank's
    log file, freed memory returned to the system, one intra-op thread. Returns (role, run)."""
    role = role_from_env(num_servers, num_workers)
    keep_freed_memory()
    run = RunDir(out)
    setup_logging(run, rank=role.rank)
    torch.set_num_threads(1)
    return role, run


def build_server(
    role: Role,
    run: RunDir,
    spec: TableSpec,
    rows_opt: RowOptConfig,
    dense_model: SparseModel,
    dense_optimizer: str,
    lr: float,
    staleness: int,
    seed: int,
    keymap: KeyMap | None = None,
) -> tuple[ParamServer, int | None]:
    """This server's shard of table ``spec``, its slice of ``dense_model``'s dense parameters (their
    initial values: built by the caller as one-process training builds them) with a ``dense_optimizer``
    of rate ``lr``, ``keymap`` on server 0, restored from the run's latest checkpoint if there is one.
    Returns (ParamServer, restored step or None)."""
    shard = EmbeddingShard([spec], role.index, role.num_servers, rows_opt, seed)
    flat = flatten(dense_model.dense_parameters())
    lo, hi = contiguous_part(flat.numel(), role.index, role.num_servers)
    dense = DenseStore(flat[lo:hi], dense_optimizer, lr)
    del flat
    server = ParamServer(
        role.index, role.num_servers, role.num_workers, shard, dense, staleness, run.ckpt_dir
    )
    if keymap is not None and role.index == 0:  # the key map of every field, in server 0's checkpoint
        server.keymap = keymap
    restored = server.restore_latest()
    if restored is not None:
        log.info(
            "server %d: restored shard from checkpoint step %d (attempt %d)",
            role.index,
            restored,
            role.attempt,
        )
    return server, restored


def serve(
    server: ParamServer,
    role: Role,
    run: RunDir,
    restored: int | None,
    timeout_s: float,
    threads: int = 16,
    services: dict[str, object] | None = None,
) -> int:
    """Serve ``server`` (and ``services``: name -> object, e.g. a stream's `Coordinator`) through the transport until
    a worker calls its ``finish``; then write ``RUN/counters/server-I.json``. Returns 0."""
    with ps_session(role, timeout_s, threads, {"ps": server, **(services or {})}) as transport:
        server.serve()
    counters = {
        **server.counters,
        **{f"transport_{k}": round(v, 4) for k, v in transport.stats.items()},
        **(server.keymap.counters() if server.keymap is not None else {}),
        "address": transport.address,  # what it announced: the workers' way in
        "restored_from": restored,
        "attempt": role.attempt,
    }
    (run.path / "counters").mkdir(exist_ok=True)
    (run.path / "counters" / f"server-{role.index}.json").write_text(json.dumps(counters) + "\n")
    return 0


def assemble_model(
    client, dense_model: SparseModel, build_full: Callable[[torch.Tensor], SparseModel], num_rows: int
) -> tuple[SparseModel, torch.Tensor, torch.Tensor]:
    """The whole model from the servers: every shard's rows in global order and the dense parameters
    (copied into ``dense_model`` too). ``build_full(table [num_rows, K])`` builds the application's model
    around the table; its dense parameters get the servers' values. Returns (model, table [N, K],
    seen [N] bool)."""
    tables, dense_flat = client.dump({TABLE: num_rows})
    unflatten_into(dense_flat, dense_model.dense_parameters())
    weight, seen = tables[TABLE]
    full = build_full(weight)
    with torch.no_grad():
        for p, q in zip(full.dense_parameters(), dense_model.dense_parameters(), strict=True):
            p.copy_(q)
    return full, weight, seen


class TableClient:
    """`pull` from a full in-memory table [N, K] (scores an assembled model)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def pull(self, reqs: dict[str, torch.Tensor], step: int = -1, want_dense: bool = False):
        return {n: self.weight.index_select(0, r) for n, r in reqs.items()}, None


class Coordinator:
    """Announcements of worker 0 to the workers, kept by server 0: announcement ``seq`` is a list with one
    entry per worker (its list of per-step `Batch` parts) or None (stop); ``done[seq]``: workers whose part
    the servers applied."""

    def __init__(self, num_workers: int, stop: threading.Event):
        self.W, self.stop = num_workers, stop
        self.cond = threading.Condition()
        self.jobs: dict[int, list | None] = {}
        self.done: dict[int, set[int]] = {}

    def announce(self, seq: int, parts: list | None) -> None:
        with self.cond:
            self.jobs[seq] = parts
            self.cond.notify_all()

    def fetch(self, seq: int, worker: int):
        with self.cond:
            self.cond.wait_for(lambda: seq in self.jobs or self.stop.is_set())
            parts = self.jobs.get(seq)
            return None if parts is None else parts[worker]

    def part_done(self, seq: int, worker: int) -> None:
        with self.cond:
            self.done.setdefault(seq, set()).add(worker)
            self.cond.notify_all()

    def wait_parts(self, seq: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: len(self.done.get(seq, ())) >= self.W or self.stop.is_set())
            self.jobs.pop(seq, None)  # the rows of a finished file are not kept
            self.done.pop(seq, None)
