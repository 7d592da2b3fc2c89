"""The LogStore: copies a running job's files into the database, incrementally, from the service side.

Called by the service's LogStore thread about twice a second for every running job, at a lower CPU
priority than the jobs, and once more by the scheduler thread when a job ends.
The job itself writes nothing extra (training is never slowed): this reads what every run writes anyway:

- ``RUN/metrics.jsonl`` -> ``metric_records`` (one row per complete line, ``seq`` 1, 2, ...),
- ``RUN/counters/*.jsonl`` -> ``counter_records`` (parameter-server worker counters),
- ``RUN/counters/server-*.json`` and ``RUN/counters.json`` -> the job's latest ``counters``,
- at the end ``RUN/metrics.json`` -> ``final_metrics`` and ``RUN/model.safetensors`` -> ``export``.

Files are read from the byte offset stored in ``tail_offsets``; only complete lines are consumed and the
new offset is committed in the same transaction as the records, so nothing is lost or stored twice across
a service restart. Lines that are not JSON objects are skipped and counted (``corrupt_lines``).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from .db import CounterRecord, Database, Job, MetricRecord, TailOffset

# Metric names a run reports for evaluation, most important first; True = higher is better.
_METRICS = [("auc", True), ("top1", True), ("accuracy", True), ("acc", True), ("wer", False),
            ("ser", False), ("logloss", False), ("loss", False)]  # fmt: skip
_EVAL_KEY = re.compile(r"^(eval|val|valid|test)_(.+)$")
_MAX_READ = 4 << 20  # bytes per file per poll: a huge backlog is consumed over several polls


def _metric_of(record: dict) -> tuple[str, float, bool, int] | None:
    """The most important evaluation metric in a record: (name, value, higher_is_better, rank)."""
    best = None
    for key, value in record.items():
        m = _EVAL_KEY.match(key)
        if not m or not isinstance(value, int | float) or isinstance(value, bool) or value != value:
            continue
        for rank, (base, higher) in enumerate(_METRICS):
            if m.group(2) == base:
                if best is None or rank < best[3]:
                    best = (key, float(value), higher, rank)
                break
    return best


def update_best(job: Job, record: dict) -> None:
    """Fold one record into ``job.best_metric`` (``{"name", "value", "step"}``)."""
    m = _metric_of(record)
    if m is None:
        return
    name, value, higher, rank = m
    cur = job.best_metric
    cur_rank = next((i for i, (b, _) in enumerate(_METRICS) if cur and cur["name"].endswith("_" + b)), 99)
    if cur is not None and cur["name"] == name:
        better = value > cur["value"] if higher else value < cur["value"]
        if not better:
            return
    elif cur is not None and cur_rank <= rank:
        return
    job.best_metric = {"name": name, "value": value, "step": record.get("step")}


def read_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """Complete lines of ``path`` from ``offset``; returns them and the offset after the last one."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read(_MAX_READ)
    except FileNotFoundError:
        return [], offset
    end = chunk.rfind(b"\n")
    if end < 0:
        return [], offset
    return chunk[: end + 1].decode("utf-8", "replace").splitlines(), offset + end + 1


def parse_record(line: str) -> dict | None:
    """A JSON object line as a dict; None for anything else."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def _num(v, kind):
    return kind(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


class _Pass:
    """One ingest pass over one job's files inside one write transaction: reads each file from its stored
    offset, adds the records, and collects the job's ``counters`` (written back once, if changed)."""

    def __init__(self, s: Session, job: Job):
        self.s, self.job = s, job
        rows = s.scalars(select(TailOffset).where(TailOffset.job_id == job.id))
        self.offsets: dict[str, TailOffset] = {r.file: r for r in rows}
        self.counters = dict(job.counters or {})
        self.changed = False

    def tail(self, name: str, path: Path) -> list[dict]:
        """The new complete JSON lines of ``path`` (its offset stored under ``name`` moves past them);
        corrupt lines are counted in ``counters["corrupt_lines"]``."""
        row = self.offsets.get(name)
        if row is None:
            row = TailOffset(job_id=self.job.id, file=name, offset=0)
            self.s.add(row)
            self.offsets[name] = row
        lines, end = read_lines(path, row.offset)
        if end == row.offset:
            return []
        row.offset = end
        recs = []
        for line in lines:
            if not line.strip():
                continue
            rec = parse_record(line)
            if rec is None:
                self.counters["corrupt_lines"] = self.counters.get("corrupt_lines", 0) + 1
                self.changed = True
            else:
                recs.append(rec)
        return recs

    def set_counter(self, key: str, value) -> None:
        self.counters[key] = value
        self.changed = True


class LogStore:
    def __init__(self, db: Database):
        self.db = db
        # ingest runs on the LogStore thread and (via finalize) on the scheduler thread: one at a time per
        # service, so an offset is never read twice.
        self._lock = threading.RLock()

    def ingest(self, job_id: int) -> int:
        """Read what is new in the job's files into the database; returns the number of new records."""
        with self._lock, self.db.write() as s:
            job = s.get(Job, job_id)
            if job is None or not job.run_dir:
                return 0
            run = Path(job.run_dir)
            p = _Pass(s, job)
            new = self._metrics(p, run / "metrics.jsonl")
            if (run / "counters").is_dir():
                new += self._worker_counters(p, run / "counters")
                self._server_counters(p, run / "counters")
            final_counters = run / "counters.json"
            if final_counters.is_file():
                rec = parse_record(final_counters.read_text())
                if rec is not None and p.counters.get("final") != rec:
                    p.set_counter("final", rec)
            if p.changed:
                job.counters = p.counters
            return new

    def _metrics(self, p: _Pass, path: Path) -> int:
        """New lines of ``RUN/metrics.jsonl`` -> `MetricRecord` rows (last step, best metric folded into the
        job); -> how many."""
        recs = p.tail("metrics.jsonl", path)
        if recs:
            seq = self._last_seq(p.s, MetricRecord, p.job.id)
            for rec in recs:
                seq += 1
                time, step = _num(rec.get("time"), float), _num(rec.get("step"), int)
                p.s.add(MetricRecord(job_id=p.job.id, seq=seq, time=time, step=step, data=rec))
                self._fold(p.job, rec)
        return len(recs)

    def _worker_counters(self, p: _Pass, cdir: Path) -> int:
        """New lines of ``RUN/counters/*.jsonl`` (one file per worker) -> `CounterRecord` rows, and each
        worker's record count and last record in the job's counters; -> how many."""
        new, cseq = 0, None
        for path in sorted(cdir.glob("*.jsonl")):
            recs = p.tail("counters/" + path.name, path)
            if not recs:
                continue
            if cseq is None:
                cseq = self._last_seq(p.s, CounterRecord, p.job.id)
            for rec in recs:
                cseq += 1
                time = _num(rec.get("time"), float)
                p.s.add(CounterRecord(job_id=p.job.id, seq=cseq, source=path.stem, time=time, data=rec))
                update_best(p.job, rec)
            workers = dict(p.counters.get("workers", {}))
            workers[path.stem] = {"records": workers.get(path.stem, {}).get("records", 0) + len(recs),
                                  "last": recs[-1]}  # fmt: skip
            p.set_counter("workers", workers)
            new += len(recs)
        return new

    @staticmethod
    def _server_counters(p: _Pass, cdir: Path) -> None:
        """``RUN/counters/server-*.json`` (each parameter server's latest snapshot) into the job's counters."""
        for path in sorted(cdir.glob("server-*.json")):
            rec = parse_record(path.read_text()) if path.is_file() else None
            if rec is not None and p.counters.get("servers", {}).get(path.stem) != rec:
                p.set_counter("servers", {**p.counters.get("servers", {}), path.stem: rec})

    def _fold(self, job: Job, rec: dict) -> None:
        step = _num(rec.get("step"), int)
        if step is not None and (job.last_step is None or step > job.last_step):
            job.last_step = step
        update_best(job, rec)

    @staticmethod
    def _last_seq(s: Session, table, job_id: int) -> int:
        row = s.scalars(select(table.seq).where(table.job_id == job_id).order_by(table.seq.desc()).limit(1))
        return row.first() or 0

    def finalize(self, job_id: int) -> None:
        """The last read of a finished job, plus ``RUN/metrics.json`` and the exported model's path."""
        with self._lock:
            self._finalize(job_id)

    def _finalize(self, job_id: int) -> None:
        while self.ingest(job_id):  # drain a backlog larger than one read
            pass
        with self.db.write() as s:
            job = s.get(Job, job_id)
            run = Path(job.run_dir)
            final = run / "metrics.json"
            if final.is_file() and final.stat().st_mtime >= (job.started or 0) - 1:
                try:
                    job.final_metrics = json.loads(final.read_text())
                except ValueError:
                    pass
            model = run / "model.safetensors"
            if model.is_file() and model.stat().st_mtime >= (job.started or 0) - 1:
                job.export = str(model)


def job_files(home: str | Path, job: Job) -> Path:
    """The folder of a job's ``job.log`` and ``job.exit``: ``HOME/logs/job-ID`` when the scheduler made one at
    launch (the run directory held data of the user's, where the service writes nothing), else ``RUN``."""
    own = Path(home) / "logs" / f"job-{job.id}"
    return own if own.is_dir() else Path(job.run_dir)


def log_error(files: str | Path, offset: int) -> str | None:
    """The job's one-line error: the last ``... error: ...`` line of its part of ``job.log`` in ``files``
    (`job_files`)."""
    try:
        with open(Path(files) / "job.log", "rb") as f:
            f.seek(max(offset, f.seek(0, 2) - (256 << 10)))
            text = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("mariana: error:"):
            return ln
    for ln in reversed(lines):
        if "error:" in ln.lower() or "Error" in ln:
            return ln[:500]
    return None
