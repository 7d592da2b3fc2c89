"""Hang and lost-host detection for distributed jobs.

Every rank runs a daemon thread that publishes a heartbeat ``(step, phase, host, time)`` to the job's
TCPStore about once a second. The training loop reports progress with `Watchdog.beat` (cheap: attribute
writes). A rank without progress of its own for ``timeout_s`` names the rank(s) furthest behind from the
heartbeats (the others sit waiting in a collective), dumps its stacks, writes ``RUN/logs/stall-rank-R.json``
and exits with `EXIT_STALL` (what the user sees: platform/README.md, "Data parallel"); the other ranks dump
theirs on torchrun's SIGTERM (faulthandler is registered for it). A rank that has waited a while also
watches the others: a peer whose heartbeat has not changed for the peer timeout (``timeout_s / 2``, at most
`PEER_LOST_S`), or a store that does not answer for that long, is a lost host (down or cut off: its
collectives would wait for the process group's timeout): `exit_lost`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from .workerio import AGENT_ENV, RUN_DIR_ENV

EXIT_STALL = 75
# Order of phases inside one optimizer step: a rank in an earlier phase than the others is the one behind.
PHASES = {"init": 0, "data": 1, "compute": 2, "comm": 3, "optim": 4}
# A live rank's thread publishes every second, so a minute of silence is a lost host; with detection and
# the launcher's exit the job ends within 120 s of losing one (platform/README.md, "Multi-node").
PEER_LOST_S = 60.0
LOST_GRACE_S = 10.0  # how long a rank that lost a host waits for its launcher to stop it


def exit_lost(rank: int, message: str) -> None:
    """End this rank for a lost host (``message`` names it) through ``RUN/logs/stall-rank-R.json``: this node's
    launcher prints it and stops the node's job, no restart; exit `EXIT_STALL` if no launcher stopped this
    process within `LOST_GRACE_S`. Meanwhile the rank's other threads stay blocked where they are."""
    print(f"[mariana] rank {rank}: {message}", file=sys.__stderr__, flush=True)
    agent = int(os.environ.get(AGENT_ENV, 0))  # the launcher that acts on it
    report = dict(rank=rank, message=message, lost=True, host=socket.gethostname(), agent=agent)
    if run := os.environ.get(RUN_DIR_ENV):
        with contextlib.suppress(OSError):
            (Path(run) / "logs" / f"stall-rank-{rank}.json").write_text(json.dumps(report))
    time.sleep(LOST_GRACE_S)
    os._exit(EXIT_STALL)


def _connect_store(timeout_s: float):
    """A separate client connection to the job's TCPStore (the watchdog thread must not share the
    process group's connection with the main thread)."""
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=max(5.0, timeout_s)))
    except Exception:  # the report degrades to this rank's view only
        return None


class Watchdog:
    def __init__(self, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.peer_timeout_s, self.host = min(timeout_s / 2, PEER_LOST_S), socket.gethostname()
        self._seen: dict[int, tuple[bytes, float]] = {}  # peer -> (its heartbeat, when it changed here)
        self.step, self.phase = 0, "init"
        self.last_progress = time.monotonic()
        self.armed = False  # armed by the first beat, so slow start-up (imports, data loading) is not a hang
        self.report_dir: Path | None = None
        self.attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._store = _connect_store(self.peer_timeout_s)  # a store read fails within the peer timeout
        self._stop, self._store_ok = threading.Event(), time.monotonic()  # when a store call last returned
        # On SIGTERM (torchrun stopping the job after another rank failed) print our stacks, then die.
        faulthandler.register(signal.SIGTERM, file=sys.__stderr__, all_threads=True, chain=True)
        self._thread = threading.Thread(target=self._run, name="mariana-watchdog", daemon=True)
        self._thread.start()
        threading.Thread(target=self._guard, name="mariana-watchdog-guard", daemon=True).start()

    # --- called from the training loop -------------------------------------------------------------
    def beat(self, step: int, phase: str = "data") -> None:
        self.step, self.phase = step, phase
        self.last_progress = time.monotonic()
        self.armed = True

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.last_progress = time.monotonic()

    def disarm(self) -> None:
        self.armed = False

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)  # its last beat says "done": the others do not take this end for a lost host

    # --- the thread ------------------------------------------------------------------------------------
    def _key(self, rank: int) -> str:
        return f"mariana/hb/{self.attempt}/{rank}"

    def _publish(self) -> None:
        if self._store is None:
            return
        age = time.monotonic() - self.last_progress
        value = json.dumps({"step": self.step, "phase": self.phase, "host": self.host, "idle_s": round(age, 1),
                            "t": time.time()})  # fmt: skip
        try:
            self._store.set(self._key(self.rank), value)
            self._store_ok = time.monotonic()
        except Exception:  # kept: a store silent for the peer timeout is a lost host (`_lost_peers`)
            pass

    def _heartbeats(self) -> dict[int, dict]:
        beats: dict[int, dict] = {}
        if self._store is None:
            return beats
        for r in range(self.world_size):
            try:
                if self._store.check([self._key(r)]):
                    beats[r] = json.loads(self._store.get(self._key(r)))
            except Exception:
                pass
        return beats

    def _run(self) -> None:
        period = min(1.0, self.timeout_s / 10)
        self._publish()  # at once: a host cut off in its first period is named, not "?"
        while not self._stop.wait(period):
            self._publish()
            idle = time.monotonic() - self.last_progress
            if idle <= self.peer_timeout_s / 4:
                self._seen.clear()  # progressing: the peers are there
            elif lost := self._lost_peers():
                exit_lost(self.rank, lost)
            if self.armed and idle > self.timeout_s:
                self._fire()
        self.phase = "done"
        self._publish()

    def _guard(self) -> None:
        """A TCPStore call to a host cut off can outlive its timeout, blocking `_run`: no store call
        returned for twice the peer timeout is a lost host too."""
        while self._store is not None and not self._stop.wait(1.0):
            if time.monotonic() - self._store_ok > 2 * self.peer_timeout_s:
                exit_lost(self.rank, self._store_lost())

    def _store_lost(self) -> str:
        return f"lost host {os.environ.get('MASTER_ADDR')} (the job's store): no answer for {self.peer_timeout_s:.0f} s"

    def _lost_peers(self) -> str:
        """'' or why the job is lost: a peer's heartbeat unchanged (its host down or cut off from the
        network), or the store silent (this host cut off, or the store's host down), for the peer timeout."""
        now, keys = time.monotonic(), {r: self._key(r) for r in range(self.world_size) if r != self.rank}
        try:
            beats = {r: self._store.get(k) if self._store.check([k]) else b"" for r, k in keys.items()}
            self._store_ok = now
        except Exception:  # no store, or no answer within its timeout (the peer timeout)
            return "" if self._store is None else self._store_lost()
        for r, b in beats.items():
            if b'"phase": "done"' not in b and self._seen.get(r, (None,))[0] != b:
                self._seen[r] = (b, now)
        lost = sorted(r for r, (b, t) in self._seen.items() if now - t > self.peer_timeout_s)
        hosts = sorted({json.loads(self._seen[r][0] or "{}").get("host", "?") for r in lost})
        return lost and f"lost host {', '.join(hosts)} (rank(s) {lost}): no heartbeat for {self.peer_timeout_s:.0f} s"  # fmt: skip

    def _fire(self) -> None:
        """Report a stall, exit with `EXIT_STALL`; the report's ``message`` is the launcher's console line."""
        beats = self._heartbeats()
        beats[self.rank] = {"step": self.step, "phase": self.phase, "t": time.time()}
        now = time.time()
        order = {r: (b["step"], PHASES.get(b["phase"], 0)) for r, b in beats.items()}
        behind = min(order.values())
        stalled = sorted(r for r, o in order.items() if o == behind)
        if len(stalled) == len(order) and len(order) > 1:
            stalled = []  # everyone at the same point: no single rank behind
        missing = sorted(set(range(self.world_size)) - set(beats))
        lines = [
            f"[mariana watchdog] rank {self.rank}: no progress for {self.timeout_s:.0f}s "
            f"(--timeout) at step {self.step}, phase {self.phase!r}.",
            *(
                f"[mariana watchdog]   rank {r}: step {b['step']} phase {b['phase']!r}, "
                f"heartbeat {now - b['t']:.1f}s ago"
                for r, b in sorted(beats.items())
            ),
        ]
        if missing:
            lines.append(f"[mariana watchdog]   no heartbeat from rank(s) {missing}")
        culprits = sorted(set(stalled) | set(missing))
        lines.append(
            f"[mariana watchdog] stalled rank(s): {culprits}"
            if culprits
            else "[mariana watchdog] all ranks stopped at the same point (a shared resource or a collective hangs)"
        )
        message = f"watchdog on rank {self.rank}: no progress for {self.timeout_s:.0f}s; stalled rank(s): {culprits}"  # fmt: skip
        print("\n".join(lines), file=sys.__stderr__, flush=True)
        print(f"[mariana watchdog] Python stacks of rank {self.rank}:", file=sys.__stderr__, flush=True)
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        if self.report_dir is not None:
            report = {"rank": self.rank, "step": self.step, "phase": self.phase, "message": message,
                      "stalled_ranks": culprits, "heartbeats": beats, "timeout_s": self.timeout_s}  # fmt: skip
            try:
                (self.report_dir / f"stall-rank-{self.rank}.json").write_text(json.dumps(report, indent=2))
            except OSError:
                pass
        sys.__stderr__.flush()
        os._exit(EXIT_STALL)
