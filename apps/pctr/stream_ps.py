"""``mariana pctr stream --servers S --workers W``: the stream of `stream.py` on parameter servers.

Job layout: the one of ``pctr train --servers S --workers W`` (torchrun through `run_job`, TensorPipe RPC;
ranks ``0..S-1`` servers, ``S..S+W-1`` workers). Servers hold the sharded table and the dense parameters
with their optimisers (`ps.py`'s ``_serve``); server 0 also keeps the stream's *announcements*
(`Coordinator`).

Worker 0 is the stream (`PSStreamer`, a `Streamer` whose model lives on the servers): it alone scans the
folder, keeps the consumed-file ledger and decides what comes next, so the workers never disagree about
the files. Per file it

1. reads the file (the training reader) and scores it with the current model before training on it
   (progressive AUC/logloss: the whole table and the dense parameters are pulled from the servers, unseen
   rows use the OOV row, as serving does);
2. cuts the rows into steps: step ``j`` takes rows ``[j*W*B, (j+1)*W*B)`` (``B`` = --batch-size; a last
   remainder of fewer than W rows joins the step before), and worker ``w`` trains its contiguous part
   `contiguous_part` of each step's rows. Every worker therefore runs the same number of steps per file
   (needed by --staleness 0 and s > 0, whose steps wait for every worker), and under --staleness 0 step
   ``j`` applies the mean of the W workers' gradients of step ``j``'s rows (synchronous SGD with a global
   batch of W*B rows; with W = 1 exactly the one-process stream). A file with fewer valid rows than W is
   scored and consumed but not trained on (a warning);
3. announces the parts to server 0; every worker fetches its part, trains on it with the platform
   `Trainer` and its persistent `PSWorkerStep` (asynchronously by default, as ``pctr train``), waits until
   the servers applied its pushes and reports the part done;
4. once all W parts are done: appends the file to the ledger, exports when --export-every is due (the
   table pulled from the servers, the normal pCTR export, so ``mariana serve --pctr RUN --watch`` picks it
   up), and checkpoints: ``checkpoints/step_T/stream.json`` (ledger, totals, the workers' step T, the
   announcement count) is written atomically first, then the servers write their shards into the same
   folder and switch ``latest`` (`ParamServer.checkpoint`).

Restart: a killed process makes torchrun restart the whole group (``--max-restarts``); a stopped or killed
job continues with ``--resume``. Either way the servers restore ``latest`` and every worker reads the
same ``stream.json`` (its step T and announcement count), so the file that was in progress is trained on
again from the state before it and no consumed file is read again. Under --staleness 0 the result equals
an uninterrupted stream (the tests compare the weights); asynchronous runs are not deterministic anyway.

Stops: ``--max-files`` and ``--idle-exit`` stop cleanly (worker 0 exports what is not exported yet,
checkpoints, tells the workers and the servers to finish). Ctrl-C/SIGTERM stop the whole job at once as
for ``pctr train --servers`` (the launcher stops every process): the file in progress is not in the
ledger and is trained on again after ``--resume``.

Not supported with servers (refused by `check_ps_stream`): --init-from, --ids dynamic, --image-features,
--nnodes > 1, libFM without --num-fields.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from mariana.platform.core.errors import MarianaError

from .stream import StreamConfig, Streamer, _stream_setup, parse_export_every

log = logging.getLogger("mariana")

STREAM_STATE = "stream.json"


def check_ps_stream(cfg: StreamConfig) -> None:
    """MarianaError for what a parameter-server stream cannot do (called by `StreamConfig.validate`)."""
    if cfg.workers < 1:
        raise MarianaError(f"--workers must be >= 1, got {cfg.workers}")
    if getattr(cfg, "nnodes", 1) > 1:
        raise MarianaError("`pctr stream --servers >= 1` runs on one host so far; --nnodes must be 1")
    if cfg.init_from:
        raise MarianaError(
            "--init-from is not supported by `pctr stream --servers >= 1` yet; use --servers 0"
        )
    if getattr(cfg, "ids", "hash") != "hash":
        raise MarianaError("--ids dynamic is not supported with --servers >= 1; use --ids hash")
    if cfg.format == "libfm" and cfg.num_fields <= 0:
        raise MarianaError(
            "`pctr stream --servers >= 1` with --format libfm needs --num-fields (every process builds the "
            "model before the first file arrives)"
        )


# --------------------------------------------------------------------------- the coordinator (server 0)
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


_CO: Coordinator | None = None


def _co_announce(seq, parts):
    return _CO.announce(seq, parts)


def _co_fetch(seq, worker):
    return _CO.fetch(seq, worker)


def _co_done(seq, worker):
    return _CO.part_done(seq, worker)


def _co_wait(seq):
    return _CO.wait_parts(seq)


# --------------------------------------------------------------------------- cutting a file into steps
def step_parts(rows, batch_size: int, workers: int) -> list[list]:
    """``rows`` (a `Batch` of N rows) -> one list per worker of T step batches (module docstring, 2.);
    every part is non-empty and a copy (an RPC would send a view's whole storage). [] if N < workers."""
    from mariana.platform.ps.shard import contiguous_part

    from .data import Batch

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


class _ServersCheckpoint:
    """The per-file `Trainer` neither writes nor loads checkpoints: the stream checkpoints the servers
    after each file (with the ledger) and sets the step itself."""

    resume_from_servers = True

    def save(self, step, progress) -> None:
        pass

    def load(self, step):
        return None


def train_part(cfg, step, batches: list, ctx, run) -> int:
    """Train ``batches`` with the platform `Trainer` and the persistent `PSWorkerStep` (its step counter
    ``t`` continues across files); waits until the servers applied this worker's pushes."""
    from mariana.platform.core.loop import Trainer
    from mariana.platform.core.rundir import RunDir

    from .step import PullAheadLoader

    if not batches:
        return 0
    loader = ListLoader(batches)
    if step.pulls_ahead:
        loader = PullAheadLoader(loader, step)
    tcfg = dataclasses.replace(cfg, resume=False, progress=False, init_from="")
    r = RunDir(run.path, create=False)
    r.write_final = lambda *a, **k: None  # metrics.json holds the stream's totals
    start = step.t
    trainer = Trainer(
        tcfg, step, loader, ctx, r, checkpointer=_ServersCheckpoint(), total=start + len(batches)
    )
    trainer.step = start
    trainer.fit()
    step.client.wait()
    return trainer.step - start


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
        import torch

        self.cfg, self.folder, self.run = cfg, Path(cfg.data), run
        self.role, self.client, self.step, self.ctx = role, client, step, ctx
        self.stop = stop or threading.Event()
        self.export_kind, self.export_n = parse_export_every(cfg.export_every)
        self.setup = _stream_setup(cfg, None)
        self.device = torch.device("cpu")
        self.ledger: list[dict[str, Any]] = []
        self.totals = {"files": 0, "rows": 0, "skipped_lines": 0, "steps": 0, "exports": 0}
        self.version, self.dirty, self.since_export = "", False, []
        self.last_export = time.monotonic()
        self.changed: set[str] = set()
        self.seq = 0
        state = read_state(run)
        if state is not None:
            self._load(state)

    def _load(self, s: dict[str, Any]) -> None:
        self.ledger = [dict(e) for e in s["ledger"]]
        self.totals.update(s["totals"])
        self.version, self.dirty, self.seq = str(s["version"]), bool(s["dirty"]), int(s["seq"])
        names = set(s["since_export"])
        self.since_export = [e for e in self.ledger if e["name"] in names]
        log.info(
            "resumed from %s: %d files consumed (%d rows), model version %s",
            (self.run.ckpt_dir / "latest").read_text().strip(),
            self.totals["files"],
            self.totals["rows"],
            self.version or "not exported yet",
        )

    def _model(self):
        """(model with the servers' current table and dense parameters, table [N, K], seen [N])."""
        from mariana.platform.ps.dense import unflatten_into

        from .model import build_model
        from .step import TABLE

        st = self.setup
        tables, dense_flat = self.client.dump({TABLE: st.spec.num_rows})
        unflatten_into(dense_flat, self.step.model.dense_parameters())
        weight, seen = tables[TABLE]
        full = build_model(self.cfg, st.schema, table=weight)
        full.load_dense_state_dict(self.step.model.state_dict())
        return full, weight, seen

    def score(self, rows) -> dict[str, float]:
        from mariana.platform.core.metrics import auc_logloss

        from .ps import _TableClient
        from .step import predict_batches

        if len(rows) == 0:
            return {"auc": float("nan"), "logloss": float("nan")}
        full, weight, seen = self._model()
        batches = [rows.slice(i, i + 8192) for i in range(0, len(rows), 8192)]
        probs = predict_batches(
            full, batches, _TableClient(weight), self.device, seen, self.setup.schema.rows_per_field
        )
        return auc_logloss(rows.labels.numpy(), probs)

    def train_on(self, rows) -> int:
        from mariana.platform.ps.server import server_name
        from torch.distributed import rpc

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
        rpc.rpc_sync(server_name(0), _co_announce, args=(seq, parts), timeout=0)
        steps = train_part(self.cfg, self.step, parts[0], self.ctx, self.run)
        rpc.rpc_sync(server_name(0), _co_done, args=(seq, 0), timeout=0)
        rpc.rpc_sync(server_name(0), _co_wait, args=(seq,), timeout=0)
        self.seq += 1
        self.totals["steps"] = self.step.t
        return steps

    def checkpoint(self) -> None:
        """``step_T/stream.json`` atomically, then the servers' shards into the same folder and ``latest``."""
        from mariana.platform.core.atomic import atomic_write_text

        t = self.step.t
        folder = self.run.ckpt_dir / f"step_{t:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        state = {
            "ledger": self.ledger,
            "totals": self.totals,
            "version": self.version,
            "dirty": self.dirty,
            "since_export": [e["name"] for e in self.since_export],
            "seq": self.seq,
            "step": t,
        }
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
def rpc_threads(cfg: StreamConfig) -> int:
    """RPC threads per process: the workers waiting on server 0 for the next file each hold one of its
    threads, and the pulls, pushes and dumps still need theirs."""
    return 16 + 2 * cfg.workers


def run_ps_stream_process(cfg: StreamConfig) -> int:
    """Body of one torchrun process of a parameter-server stream (role from RANK)."""
    from mariana.platform.ps.runtime import rpc_session

    from .ps import start_ps_process

    role, run = start_ps_process(cfg)
    setup = _stream_setup(cfg, None)
    if role.kind == "server":
        return _serve(cfg, role, run, setup, rpc_session)
    return _work(cfg, role, run, setup, rpc_session)


def _serve(cfg, role, run, setup, rpc_session) -> int:
    from mariana.platform.ps.server import install

    from .ps import build_server

    global _CO
    server, restored = build_server(cfg, role, run, setup)
    _CO = Coordinator(role.num_workers, server.stop)
    install(server)
    with rpc_session(role, cfg.timeout, rpc_threads(cfg)):
        server.serve()
    (run.path / "counters" / f"server-{role.index}.json").write_text(
        json.dumps({**server.counters, "restored_from": restored, "attempt": role.attempt}) + "\n"
    )
    return 0


def _work(cfg, role, run, setup, rpc_session) -> int:
    import torch
    from mariana.platform.ps.server import server_name
    from mariana.platform.ps.worker import PSClient
    from mariana.platform.runtime.dist import DistContext
    from torch.distributed import rpc

    from .step import PSWorkerStep

    (run.path / "counters").mkdir(exist_ok=True)
    state = read_state(run) or {"step": 0, "seq": 0}
    with rpc_session(role, cfg.timeout, rpc_threads(cfg)):
        client = PSClient(role.num_servers, role.index, cfg.staleness, cfg.timeout)
        step = PSWorkerStep(cfg, setup.schema, client, role, run)
        step.t = int(state["step"])
        ctx = DistContext(rank=role.index, device=torch.device("cpu"))  # workers talk to servers only
        if role.index == 0:
            streamer = PSStreamer(cfg, role, client, step, ctx, run)
            t = streamer.run_forever()
            rpc.rpc_sync(server_name(0), _co_announce, args=(streamer.seq, None), timeout=0)  # stop
            client.done()
            client.wait_all_done()
            client.finish_servers()
            log.info("stream: %d files, %d rows, %d exports", t["files"], t["rows"], t["exports"])
            return 0
        seq = int(state["seq"])
        while True:
            parts = rpc.rpc_sync(server_name(0), _co_fetch, args=(seq, role.index), timeout=0)
            if parts is None:
                break
            train_part(cfg, step, parts, ctx, run)
            rpc.rpc_sync(server_name(0), _co_done, args=(seq, role.index), timeout=0)
            seq += 1
        client.done()
    return 0
