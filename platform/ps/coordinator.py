"""`Coordinator`: announcements of one worker (the stream's worker 0) to all workers of a parameter-server
job, kept by server 0 and reached through the transport (`runtime.remote(0, "coordinator")`,
``handle.rpc_sync(timeout=0).fetch(seq, worker)``)."""

from __future__ import annotations

import threading


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
