"""``mariana pctr stream --servers S --workers W``: the stream of `streamer.py` on parameter servers.

The job is laid out as ``pctr train --servers S --workers W``; server 0 also keeps the stream's
announcements (`Coordinator`). Worker 0 is the stream (`PSStreamer`): it alone scans the folder and keeps
the ledger, so the workers never disagree about the files; it scores each file with the servers' model,
cuts it into steps (`step_parts`), announces the parts, and once all W are trained, exports and
checkpoints (``stream.json`` first, then the servers' shards). Restart, stops and what is refused:
apps/pctr/README.md, "Streaming".
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import torch
from mariana.platform.core.atomic import atomic_write_text
from mariana.platform.core.errors import MarianaError
from mariana.platform.ps.job import Coordinator, TableClient, assemble_model, serve, start_process
from mariana.platform.ps.runtime import ps_session, remote
from mariana.platform.ps.shard import contiguous_part
from mariana.platform.ps.worker import PSClient
from mariana.platform.ps.worker_step import PullAheadLoader
from mariana.platform.runtime.dist import DistContext

from ..data.encoding import Batch
from ..models.nets import build_model
from ..models.step import make_worker_step
from ..ps import make_server
from .config import StreamConfig, parse_export_every
from .streamer import Streamer, file_trainer, stream_setup

log = logging.getLogger("mariana")

STREAM_STATE = "stream.json"


# --------------------------------------------------------------------------- cutting a file into steps
def step_parts(rows, batch_size: int, workers: int) -> list[list]:
    """``rows`` (a `Batch` of N rows) -> one list per worker of T step batches: step ``j`` takes rows
    ``[j*W*B, (j+1)*W*B)`` and worker ``w`` its contiguous part of them, so every worker runs the same
    number of steps (--staleness 0 and s > 0 wait for all). Every part is non-empty and a copy (the
    transport would send a view's whole storage). [] if N < workers."""
    n, chunk = len(rows), batch_size * workers
    if n < workers:
        return []
    steps = -(-n // chunk)
    if steps > 1 and n - (steps - 1) * chunk < workers:
        steps -= 1  # a remainder too small to give every worker a row joins the step before
    out: list[list] = [[] for _ in range(workers)]
    for j in range(steps):
        lo, hi = j * chunk, (n if j == steps - 1 else (j + 1) * chunk)
        for w in range(workers):
            a, b = contiguous_part(hi - lo, w, workers)
            part = rows.slice(lo + a, lo + b)
            out[w].append(Batch(*(t.clone() for t in (part.ids, part.vals, part.dense, part.labels))))
    return out


class ListLoader:
    """`BatchLoader` over a list of batches (one pass)."""

    def __init__(self, batches: list):
        self.batches = batches
        self.batches_per_epoch = max(1, len(batches))

    def iterate(self, epoch: int, start: int = 0):
        yield from self.batches[start:]


class PartTrainer:
    """A worker's training on its parts of the files, one after the other: the platform `Trainer` (built
    for the first part) and the persistent `PSWorkerStep`, whose step counter ``t`` goes on across files."""

    def __init__(self, cfg, step, ctx, run):
        self.cfg, self.step, self.ctx, self.run = cfg, step, ctx, run
        self.trainer = None

    def train(self, batches: list) -> int:
        """Train ``batches``; wait until the servers applied this worker's pushes. Returns the steps."""
        if not batches:
            return 0
        loader = ListLoader(batches)
        if self.step.pulls_ahead:
            loader = PullAheadLoader(loader, self.step)
        if self.trainer is None:
            self.trainer = file_trainer(self.cfg, self.step, loader, self.ctx, self.run)
        steps = self.trainer.train_now(loader, self.step.t)
        self.step.client.wait()
        return steps


def read_state(run) -> dict[str, Any] | None:
    """The stream state of ``checkpoints/latest`` (None on a fresh run)."""
    latest = run.ckpt_dir / "latest"
    if not latest.is_file():
        return None
    folder = run.ckpt_dir / latest.read_text().strip()
    path = folder / STREAM_STATE
    if not path.is_file():
        raise MarianaError(
            f"checkpoint {folder} is not a `pctr stream --servers` checkpoint (no {STREAM_STATE})"
        )
    return json.loads(path.read_text())


# --------------------------------------------------------------------------- worker 0: the stream
class PSStreamer(Streamer):
    """`Streamer` on worker 0 of a parameter-server job: the folder, ledger, scoring, export and counters
    of the one-process stream (inherited: `pending`, `read`, `consume`, `run_forever`), with the model on
    the servers (`score`, `train_on`, `export`, `checkpoint` overridden)."""

    def __init__(self, cfg: StreamConfig, role, client, step, ctx, run, stop: threading.Event | None = None):
        self.cfg, self.folder, self.run = cfg, Path(cfg.data), run
        self.role, self.client, self.step, self.ctx = role, client, step, ctx
        self.stop = stop or threading.Event()
        self.export_kind, self.export_n = parse_export_every(cfg.export_every)
        self.setup = stream_setup(cfg, None)
        self.coordinator = remote(0, "coordinator")
        self.parts = PartTrainer(cfg, step, ctx, run)
        self.device = torch.device("cpu")
        self._start_records()
        self.seq = 0  # files announced to the workers
        state = read_state(run)
        if state is not None:
            self._load_records(state, (run.ckpt_dir / "latest").read_text().strip())
            self.seq = int(state["seq"])

    def _model(self):
        """(model with the servers' current table and dense parameters, table [N, K], seen [N])."""
        st = self.setup
        build = lambda w: build_model(self.cfg.net, st.schema, table=w)  # noqa: E731
        return assemble_model(self.client, self.step.model, build, st.spec.num_rows)

    def _scorer(self):
        full, weight, seen = self._model()
        return full, TableClient(weight), seen, {}

    def train_on(self, rows) -> int:
        if len(rows) == 0:
            return 0
        parts = step_parts(rows, self.cfg.batch_size, self.role.num_workers)
        if not parts:
            log.warning(
                "%d valid rows are fewer than --workers %d: the file is scored and consumed, not trained on",
                len(rows),
                self.role.num_workers,
            )
            return 0
        seq = self.seq
        self.coordinator.rpc_sync(timeout=0).announce(seq, parts)
        steps = self.parts.train(parts[0])
        self.coordinator.rpc_sync(timeout=0).part_done(seq, 0)
        self.coordinator.rpc_sync(timeout=0).wait_parts(seq)
        self.seq += 1
        self.totals["steps"] = self.step.t
        return steps

    def checkpoint(self) -> None:
        """``step_T/stream.json`` atomically, then the servers' shards into the same folder and ``latest``."""
        t = self.step.t
        folder = self.run.ckpt_dir / f"step_{t:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        state = {**self._saved_records(), "seq": self.seq, "step": t}
        atomic_write_text(folder / STREAM_STATE, json.dumps(state, default=float) + "\n")
        self.client.checkpoint(t)
        self._write_metrics()

    def _write_metrics(self) -> None:
        self.run.write_final(
            self._final_record(
                "stream, parameter-server",
                servers=self.role.num_servers,
                workers=self.role.num_workers,
                staleness=self.cfg.staleness,
            )
        )


# --------------------------------------------------------------------------- the processes
def call_threads(workers: int) -> int:
    """Threads serving calls per process of a stream of ``workers`` workers: the workers waiting on server 0 for the
    next file each hold one of its threads, and the pulls, pushes and dumps still need theirs."""
    return 16 + 2 * workers


def run_ps_stream_process(cfg: StreamConfig) -> int:
    """Body of one torchrun process of a parameter-server stream (role from RANK)."""
    role, run = start_process(cfg.servers, cfg.workers, cfg.out)
    setup = stream_setup(cfg, None)
    if role.kind == "server":
        server, restored = make_server(
            role, run, setup, cfg.net, cfg.table, cfg.optim, cfg.rows, cfg.staleness, cfg.seed
        )
        services = {"coordinator": Coordinator(role.num_workers, server.stop)} if role.index == 0 else {}
        return serve(server, role, run, restored, cfg.timeout, call_threads(cfg.workers), services)
    (run.path / "counters").mkdir(exist_ok=True)
    state = read_state(run) or {"step": 0, "seq": 0}
    with ps_session(role, cfg.timeout, call_threads(cfg.workers)):
        client = PSClient(role.num_servers, role.index, cfg.staleness, cfg.timeout)
        step = make_worker_step(cfg, setup.schema, client, role, run)
        step.t = int(state["step"])
        ctx = DistContext(rank=role.index, device=torch.device("cpu"))  # workers talk to servers only
        if role.index == 0:
            streamer = PSStreamer(cfg, role, client, step, ctx, run)
            t = streamer.run_forever()
            streamer.coordinator.rpc_sync(timeout=0).announce(streamer.seq, None)  # stop
            client.done()
            client.wait_all_done()
            client.finish_servers()
            log.info("stream: %d files, %d rows, %d exports", t["files"], t["rows"], t["exports"])
            return 0
        coordinator, parts_trainer = remote(0, "coordinator"), PartTrainer(cfg, step, ctx, run)
        seq = int(state["seq"])
        while (parts := coordinator.rpc_sync(timeout=0).fetch(seq, role.index)) is not None:
            parts_trainer.train(parts)
            coordinator.rpc_sync(timeout=0).part_done(seq, role.index)
            seq += 1
        client.done()
    return 0
