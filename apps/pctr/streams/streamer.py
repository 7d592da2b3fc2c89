"""``mariana pctr stream``: follow a folder of click logs, train on each new file once, export on schedule.

What counts as a file, arrival order, per-file steps (read, score, train, export, checkpoint with the
consumed-file ledger), restart, stop conditions and outputs: apps/pctr/README.md, "Streaming". One process:
`Streamer` (`LocalStep`: table and optimiser state stay in memory across files); parameter servers:
`servers.py`. A handler module (torch at the top): the command line's parser must not import it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.evaluator import auc_logloss
from mariana.platform.core.loop import Trainer
from mariana.platform.core.rundir import RunDir, setup_logging
from mariana.platform.ps.pull import predict_batches
from mariana.platform.runtime.dist import DistContext, resolve_device
from mariana.platform.sparse.rules import keep_freed_memory

from ..data.reader import ClickSource
from ..models.step import make_local_step
from ..train import Setup, warm_start
from .config import StreamConfig, parse_export_every
from .folder import LogFile, read_unit, scan
from .records import StreamRecords

log = logging.getLogger("mariana")


# --------------------------------------------------------------------------- training pieces
class MemoryLoader:
    """`BatchLoader` over one file's rows in memory: one pass in file order, batches of ``batch_size``
    (the last one may be short: every row is trained on once)."""

    def __init__(self, rows, batch_size: int):
        self.rows, self.bs = rows, batch_size
        self.batches_per_epoch = max(1, -(-len(rows) // batch_size))

    def iterate(self, epoch: int, start: int = 0):
        for k in range(start, self.batches_per_epoch):
            yield self.rows.slice(k * self.bs, (k + 1) * self.bs)


def file_trainer(cfg, step, loader, ctx, run: RunDir) -> Trainer:
    """The one platform `Trainer` of a stream, trained file by file (`Trainer.train_now`): no progress bar
    (a stream has no end), no evaluation, checkpoints or export of its own (the stream does those)."""
    cfg = dataclasses.replace(cfg, resume=False, progress=False, init_from="")
    return Trainer(cfg, step, loader, ctx, run)


def stream_setup(cfg: StreamConfig, first: LogFile | None):
    """`train.Setup` for a stream: its `ClickSource` made on a probe file (the first file for libFM
    without --num-fields, else an empty file), which gives the schema and encoder; a stream has no
    splits, so its lines are never counted."""
    with tempfile.TemporaryDirectory(prefix="mariana-stream-") as tmp:
        probe = Path(tmp) / "empty.txt"
        probe.touch()
        if first is not None and first.paths:
            probe = first.paths[0]
        return Setup(cfg, ClickSource.from_sections(cfg.input, cfg.rows, probe))


class Streamer(StreamRecords):
    """The state of one stream: the step (model, table, optimisers), the ledger, counters. ``run_forever``
    is the loop; the pieces are methods so that tests and benchmarks can drive them."""

    def __init__(self, cfg: StreamConfig, stop: threading.Event | None = None):
        self.cfg, self.folder = cfg, Path(cfg.data)
        self.run = RunDir(cfg.out)
        setup_logging(self.run)
        self.stop = stop or threading.Event()  # set: finish the file in progress, then stop
        self.export_kind, self.export_n = parse_export_every(cfg.export_every)
        first = None
        if cfg.format == "libfm" and cfg.num_fields <= 0 and not (cfg.resume and self.run.has_checkpoint()):
            first = self._wait_first()  # the number of fields comes from the first file
            if first is None:
                raise MarianaError(f"--data {cfg.data}: no file arrived to infer the libFM fields from")
        self.setup = stream_setup(cfg, first)
        if cfg.format == "libfm":
            cfg.num_fields = self.setup.schema.num_fields  # recorded in config.toml for --resume
        self.run.save_config(cfg)
        torch.manual_seed(cfg.seed)
        self.device = resolve_device(cfg.device)
        keep_freed_memory()
        self.step = make_local_step(cfg, self.setup, self.device)
        self.step.setup(1)
        self.trainer: Trainer | None = None  # built for the first file (`train_on`)
        self.ctx = DistContext(device=self.device)
        self._start_records()
        if cfg.resume:
            self._restore()
        elif cfg.init_from:
            warm_start(self.step, cfg.run, cfg.rows, cfg.warm)

    # ---------------------------------------------------------------- folder
    def _wait_first(self) -> LogFile | None:
        deadline = time.monotonic() + self.cfg.idle_exit if self.cfg.idle_exit else math.inf
        while not self.stop.is_set() and time.monotonic() < deadline:
            files = scan(self.folder, self.cfg.files)
            if files:
                return files[0]
            self.stop.wait(self.cfg.poll)
        return None

    def pending(self) -> list[LogFile]:
        """Complete units not yet consumed, in arrival order (a consumed one that changed: warned once)."""
        done = {e["name"]: e for e in self.ledger}
        out = []
        for f in scan(self.folder, self.cfg.files):
            e = done.get(f.name)
            if e is None:
                out.append(f)
            elif (e["size"], e["mtime_ns"]) != (f.size, f.mtime_ns) and f.name not in self.changed:
                self.changed.add(f.name)
                log.warning("%s changed after it was consumed; it is not read again", self.folder / f.name)
        return out

    # ---------------------------------------------------------------- one file
    def read(self, f: LogFile):
        """`read_unit` of ``f`` with the stream's encoder: (rows or None, skipped lines, first skipped)."""
        return read_unit(f, self.setup.encoder, self.folder)

    def score(self, rows) -> dict[str, float]:
        """Progressive validation: AUC/logloss of the current model on ``rows`` (before training on them)."""
        if len(rows) == 0:
            return {"auc": float("nan"), "logloss": float("nan")}
        batches = [rows.slice(i, i + 8192) for i in range(0, len(rows), 8192)]
        model, client, seen, extra = self._scorer()
        probs = predict_batches(
            model, batches, client, self.device, seen, self.setup.schema.rows_per_field, **extra
        )
        return auc_logloss(rows.labels.numpy(), probs)

    def _scorer(self):
        """(model, table client, seen [rows], extra `predict_batches` keywords) `score` predicts with."""
        s = self.step
        idmap = getattr(s, "idmap", None)  # --ids dynamic
        return s.model, s.client, s.store.seen, {} if idmap is None else {"idmap": idmap}

    def train_on(self, rows) -> int:
        """One pass over ``rows`` with the platform `Trainer` and this stream's step; returns the steps."""
        if len(rows) == 0:
            return 0
        loader = MemoryLoader(rows, self.cfg.batch_size)
        if self.trainer is None:
            self.trainer = file_trainer(self.cfg, self.step, loader, self.ctx, self.run)
        steps = self.trainer.train_now(loader, self.totals["steps"])  # the run's global step goes on
        self.totals["steps"] += steps
        return steps

    def consume(self, f: LogFile) -> dict[str, Any] | None:
        """Read, score, train on ``f``; export when due; checkpoint. Returns its ledger entry (None if the
        file disappeared before it was read)."""
        t0 = time.time()
        rows, skipped, first_skipped = self.read(f)
        if rows is None:
            log.warning("%s disappeared before it was read; not consumed", self.folder / f.name)
            return None
        t1 = time.time()
        m = self.score(rows)
        t2 = time.time()
        steps = self.train_on(rows)
        done = time.time()
        entry = {
            "name": f.name,
            "size": f.size,
            "mtime_ns": f.mtime_ns,
            "landed": round(f.landed, 3),
            "rows": len(rows),
            "skipped_lines": skipped,
            "steps": steps,
            "auc": m["auc"],
            "logloss": m["logloss"],
            "read_s": round(t1 - t0, 3),
            "score_s": round(t2 - t1, 3),
            "fit_s": round(done - t2, 3),
            "train_s": round(done - t0, 3),
            "train_lag_s": round(done - f.landed, 3),
        }
        self._warn_skipped(f, entry, first_skipped)
        self.ledger.append(entry)
        self.totals["files"] += 1
        self.totals["rows"] += len(rows)
        self.totals["skipped_lines"] += skipped
        self.dirty = self.dirty or steps > 0
        self.since_export.append(entry)
        exported = self.maybe_export()
        t3 = time.time()
        self.checkpoint()
        self._file_done(f, entry, exported, export_s=t3 - done, checkpoint_s=time.time() - t3)
        return entry

    def _warn_skipped(self, f: LogFile, entry: dict[str, Any], first_skipped: str) -> None:
        """Say what was skipped in ``f`` (and record its first skipped line in ``entry``)."""
        skipped = entry["skipped_lines"]
        if skipped:
            entry["first_skipped"] = first_skipped
            log.warning(
                "skipped %d malformed line%s in %s (first: %s)",
                skipped,
                "s" * (skipped != 1),
                self.folder / f.name,
                first_skipped,
            )
        if not entry["rows"]:  # every file, whatever the cause (wrong --format, binary, empty): said
            log.warning(
                "%s yielded no valid %s rows (%d line%s skipped); nothing was trained or scored on it",
                self.folder / f.name,
                self.cfg.format,
                skipped,
                "s" * (skipped != 1),
            )

    def _file_done(
        self, f: LogFile, entry: dict[str, Any], exported: bool, export_s: float, checkpoint_s: float
    ):
        """The file's counters record (with the backlog behind it) and its log line."""
        waiting = self.pending()
        backlog = len(waiting)
        # how far this file's landing is behind the newest complete file's (0 when nothing waits)
        behind = max([0.0, *(w.landed - f.landed for w in waiting)])
        rec = {
            **self._file_record(entry),
            "export_s": round(export_s, 3),
            "checkpoint_s": round(checkpoint_s, 3),
            "backlog_files": backlog,
            "behind_newest_s": round(behind, 3),
            "step": self.totals["steps"],
        }
        if exported:
            rec.update({"version": self.version, "export_lag_s": entry.get("export_lag_s")})
        self._counters(rec)
        log.info(
            "stream: file %d %s: %d rows (%d skipped), progressive AUC %.4f logloss %.4f, %.1f s, lag %.1f s, "
            "backlog %d%s",
            self.totals["files"],
            f.name,
            entry["rows"],
            entry["skipped_lines"],
            entry["auc"],
            entry["logloss"],
            entry["train_s"],
            entry["train_lag_s"],
            backlog,
            f", exported {self.version} (lag {entry['export_lag_s']:.1f} s)" if exported else "",
        )

    # ---------------------------------------------------------------- export, checkpoint: StreamRecords
    def _model(self):
        """(model, table [rows, 1 + dim], seen [rows]) as the export writes them (the live step's)."""
        table, seen = self.step.table()
        return self.step.model, table, seen

    def _write_metrics(self) -> None:
        self.run.write_final(self._final_record("stream, single-process", device=str(self.device)))

    # ---------------------------------------------------------------- the loop
    def run_forever(self) -> dict[str, Any]:
        """Follow the folder until a stop condition (README, "Streaming"); returns the totals."""
        cfg = self.cfg
        idle_since = time.monotonic()
        reason = "stopped"
        log.info(
            "stream: following %s (model %s, export every %s, %d files consumed so far)",
            self.folder,
            cfg.model,
            cfg.export_every,
            self.totals["files"],
        )
        while not self.stop.is_set():
            if cfg.max_files and self.totals["files"] >= cfg.max_files:
                reason = f"--max-files {cfg.max_files} reached"
                break
            todo = self.pending()
            if not todo:
                if self.export_kind == "seconds" and self.maybe_export():
                    self.checkpoint()  # the export is part of the state (version, nothing pending)
                    log.info("stream: exported %s (timer)", self.version)
                if cfg.idle_exit and time.monotonic() - idle_since >= cfg.idle_exit:
                    reason = f"no new file for {cfg.idle_exit:g} s (--idle-exit)"
                    break
                self.stop.wait(cfg.poll)
                continue
            if self.consume(todo[0]) is not None:
                idle_since = time.monotonic()
        if self.maybe_export(force=True):
            self.checkpoint()
        self._write_metrics()
        log.info(
            "stream: %s; %d files, %d rows, %d skipped lines, %d exports, version %s",
            reason,
            self.totals["files"],
            self.totals["rows"],
            self.totals["skipped_lines"],
            self.totals["exports"],
            self.version or "none",
        )
        return {**self.totals, "version": self.version}


def run_stream(cfg: StreamConfig) -> dict[str, Any]:
    """Build the `Streamer` and run it; SIGINT/SIGTERM finish the file in progress and stop (a second
    SIGINT interrupts at once)."""
    stop = threading.Event()
    handled = {"n": 0}

    def on_signal(signum, frame):
        handled["n"] += 1
        if handled["n"] > 1 and signum == signal.SIGINT:
            raise KeyboardInterrupt
        log.info("stream: %s received; stopping after the file in progress", signal.Signals(signum).name)
        stop.set()

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return Streamer(cfg, stop).run_forever()
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
