"""The job database: SQLAlchemy models and engine.

Default: a SQLite file ``HOME/jobs.db`` in WAL mode (readers never block the writer, a ``kill -9`` loses
no committed transaction). Any SQLAlchemy URL works unchanged, e.g. ``postgresql+psycopg://user@host/db``
(``postgresql://`` works as is: psycopg 3 is used when psycopg2 is not installed). ``tail_offsets`` (bytes
read per file of each job) are committed together with the records, so a restarted service continues where
it stopped without duplicates.

All writes go through `Database.write`, which serialises writers inside this process (SQLite allows one
writer; a lock here avoids busy retries between the API threads and the scheduler thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import (
    JSON,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    create_engine,
    event,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    app: Mapped[str] = mapped_column(String(64))
    command: Mapped[str] = mapped_column(String(64))
    argv: Mapped[list] = mapped_column(JSON)
    cwd: Mapped[str] = mapped_column(Text, default="")
    state: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    slots: Mapped[int] = mapped_column(Integer, default=1)
    created: Mapped[float] = mapped_column(Float)
    started: Mapped[float | None] = mapped_column(Float, nullable=True)
    ended: Mapped[float | None] = mapped_column(Float, nullable=True)
    run_dir: Mapped[str] = mapped_column(Text, default="")
    log_offset: Mapped[int] = mapped_column(Integer, default=0)  # where this job's part of RUN/job.log starts
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    pid_start: Mapped[int | None] = mapped_column(Integer, nullable=True)  # /proc/PID/stat field 22
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    best_metric: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    last_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    export: Mapped[str | None] = mapped_column(Text, nullable=True)
    final_metrics: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    counters: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    retry_of: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Added after the first release (see `_add_missing_columns`): nullable, so old rows stay valid.
    resources: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # see resources.py; None = {}
    executor: Mapped[str | None] = mapped_column(String(16), nullable=True)  # "local" | "slurm"
    external_id: Mapped[str | None] = mapped_column(String(64), nullable=True)  # e.g. the Slurm job id

    def to_dict(self, now: float | None = None) -> dict:
        """The job object of the REST API (unix-second times, ``duration_s`` up to now while running)."""
        now = time.time() if now is None else now
        duration = None
        if self.started is not None:
            duration = round((self.ended if self.ended is not None else now) - self.started, 3)
        return {
            "id": self.id,
            "name": self.name,
            "app": self.app,
            "command": self.command,
            "argv": list(self.argv),
            "cwd": self.cwd,
            "state": self.state,
            "priority": self.priority,
            "slots": self.slots,
            "created": self.created,
            "started": self.started,
            "ended": self.ended,
            "duration_s": duration,
            "run_dir": self.run_dir,
            "pid": self.pid,
            "exit_code": self.exit_code,
            "error": self.error,
            "best_metric": self.best_metric,
            "last_step": self.last_step,
            "export": self.export,
            "final_metrics": self.final_metrics,
            "retry_of": self.retry_of,
            "resources": self.resources or {},
            "executor": self.executor or "local",
            "external_id": self.external_id,
        }


class JobEvent(Base):
    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    time: Mapped[float] = mapped_column(Float)
    state: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text, default="")


class MetricRecord(Base):
    __tablename__ = "metric_records"
    __table_args__ = (Index("ix_metric_job_seq", "job_id", "seq", unique=True),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"))
    seq: Mapped[int] = mapped_column(Integer)
    time: Mapped[float | None] = mapped_column(Float, nullable=True)
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    data: Mapped[dict] = mapped_column(JSON)


class CounterRecord(Base):
    __tablename__ = "counter_records"
    __table_args__ = (Index("ix_counter_job_seq", "job_id", "seq", unique=True),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"))
    seq: Mapped[int] = mapped_column(Integer)
    source: Mapped[str] = mapped_column(String(200))
    time: Mapped[float | None] = mapped_column(Float, nullable=True)
    data: Mapped[dict] = mapped_column(JSON)


class TailOffset(Base):
    __tablename__ = "tail_offsets"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    file: Mapped[str] = mapped_column(String(300), primary_key=True)
    offset: Mapped[int] = mapped_column(Integer, default=0)


def _postgres_driver(url: str) -> str:
    """``postgresql://`` means psycopg2 to SQLAlchemy; use psycopg (3) when that is what is installed."""
    import importlib.util

    rest = url.split("://", 1)[1]
    if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None:
        return "postgresql+psycopg://" + rest
    return "postgresql://" + rest


def default_url(home: str | Path) -> str:
    return f"sqlite:///{Path(home).resolve() / 'jobs.db'}"


class Database:
    """Engine + session factory. ``read()`` for queries, ``write()`` for transactions (serialised)."""

    def __init__(self, url: str):
        if url.startswith(("postgresql://", "postgres://")):
            url = _postgres_driver(url)
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        kwargs: dict = {}
        if self.is_sqlite:
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        self.engine = create_engine(url, **kwargs)
        if self.is_sqlite:

            @event.listens_for(self.engine, "connect")
            def _pragmas(dbapi_conn, _record):  # every new connection: WAL, wait instead of failing
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
                cur.execute("PRAGMA busy_timeout=30000")
                cur.execute("PRAGMA foreign_keys=ON")
                cur.close()

        Base.metadata.create_all(self.engine)
        _add_missing_columns(self.engine)
        self._factory = sessionmaker(self.engine, expire_on_commit=False)
        self._lock = threading.RLock()

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self._factory() as s:
            yield s

    @contextmanager
    def write(self) -> Iterator[Session]:
        with self._lock, self._factory() as s, s.begin():
            yield s


def _add_missing_columns(engine) -> None:
    """``create_all`` creates missing tables but never alters existing ones: a database made by an older
    version lacks the newer (nullable) columns of ``jobs``; add them, so old databases keep working."""
    from sqlalchemy import inspect

    have = {c["name"] for c in inspect(engine).get_columns("jobs")}
    missing = [c for c in Job.__table__.columns if c.name not in have]
    with engine.begin() as conn:
        for col in missing:
            assert col.nullable, col.name  # a NOT NULL column would need a default for the old rows
            kind = col.type.compile(dialect=engine.dialect)
            conn.exec_driver_sql(f"ALTER TABLE jobs ADD COLUMN {col.name} {kind}")


def add_event(s: Session, job_id: int, state: str, message: str = "", when: float | None = None) -> None:
    s.add(JobEvent(job_id=job_id, time=time.time() if when is None else when, state=state, message=message))
