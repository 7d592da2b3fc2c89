"""Console and log files of the worker processes our launcher starts (standard library only).

The launcher (`launch.run_torchrun`) exports the run directory as ``MARIANA_RUN_DIR`` and the rank whose
Python-level output may reach the console as ``MARIANA_CONSOLE_RANK``. In each worker, `WorkerIO.install`
then points file descriptors 1 and 2 at ``RUN/logs/rank-R.log`` (appending), so C++ lines (gloo), stack
dumps, warnings and tracebacks of every rank go to that rank's log. The console rank keeps a
Python ``sys.stdout``/``sys.stderr`` on the terminal for the progress bar, prints and the ``mariana``
logger's console lines.

A worker that fails records the cause in ``RUN/logs/error-rank-R.json``: ``{"rank", "kind": "user" |
"crash", "message"}`` (``message`` is the one-line cause, e.g. ``ValueError: bad value``); the launcher
turns those into one console line per cause (`failure_lines`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import traceback
import warnings
from pathlib import Path
from typing import NoReturn

from ..core.errors import MarianaError
from ..core.jsonfile import read_json

RUN_DIR_ENV = "MARIANA_RUN_DIR"
CONSOLE_RANK_ENV = "MARIANA_CONSOLE_RANK"
CONSOLE_TTY_ENV = "MARIANA_CONSOLE_TTY"  # "1" when the launcher's stderr is a terminal
PROGRESS_EVERY_ENV = "MARIANA_PROGRESS_EVERY"  # seconds between progress lines off a terminal (default 30)
AGENT_ENV = "MARIANA_AGENT_PID"  # the launcher's process (a worker's parent is its fork server)


def error_file(run_dir: str | Path, rank: int | str) -> Path:
    return Path(run_dir) / "logs" / f"error-rank-{rank}.json"


class WorkerIO:
    """This worker's log file (``log``: a text stream on it) and rank."""

    def __init__(self, run_dir: Path, rank: str, log_path: Path, log):
        self.run_dir, self.rank, self.log_path, self.log = run_dir, rank, log_path, log

    @classmethod
    def install(cls) -> WorkerIO | None:
        """Redirect this process's output if it is a worker of our launcher; None otherwise."""
        run_dir, rank = os.environ.get(RUN_DIR_ENV), os.environ.get("RANK")
        if not run_dir or rank is None:
            return None
        logs = Path(run_dir) / "logs"
        try:
            logs.mkdir(parents=True, exist_ok=True)
            for stale in (f"error-rank-{rank}.json", f"stall-rank-{rank}.json"):  # of an earlier attempt
                (logs / stale).unlink(missing_ok=True)
            fd = os.open(logs / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            return None  # keep the console; the launcher already checked --out, so this is unexpected
        sys.stdout.flush()
        sys.stderr.flush()
        if rank == os.environ.get(CONSOLE_RANK_ENV, "0"):
            # Python-level output (progress bar, console log lines, prints) stays on the terminal;
            # C++ output (gloo's connection lines) and faulthandler dumps go to the file descriptors.
            sys.stdout = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
            sys.stderr = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        log = sys.__stderr__  # file descriptor 2: the log file now
        warnings.showwarning = _warnings_to(log)
        env = os.environ  # where this rank runs and meets the others: across hosts, never loopback
        print(f"mariana: rank {rank} on {_host()}; rendezvous store {env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}; "
              f"pid {os.getpid()}", file=log, flush=True)  # fmt: skip
        io = cls(Path(run_dir), rank, logs / f"rank-{rank}.log", log)
        # Ctrl-C ends a worker where it stands: a KeyboardInterrupt raised in DDP's comm hook left ranks waiting
        signal.signal(signal.SIGINT, lambda *_: io.end(KeyboardInterrupt(), 130))
        return io

    def end(self, exc: BaseException, rc: int) -> NoReturn:
        """End this failed worker with ``rc`` at once, its training state unfreed (freeing DDP mid-all-reduce can
        deadlock): ``exc``'s traceback, message or "interrupted" to the log, its cause to error-rank-R.json."""
        user, message = isinstance(exc, MarianaError), str(exc)
        if user or isinstance(exc, KeyboardInterrupt):
            print(f"mariana: error: {message}" if user else "mariana: interrupted", file=self.log, flush=True)
        else:
            traceback.print_exception(exc, file=self.log)
            text = message.strip().splitlines()
            message = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
        if not isinstance(exc, KeyboardInterrupt):
            record = {"rank": int(self.rank), "kind": "user" if user else "crash", "message": message}
            with contextlib.suppress(OSError):
                error_file(self.run_dir, self.rank).write_text(json.dumps(record) + "\n")
        for stream in (self.log, sys.stdout, sys.stderr):
            stream.flush()
        os._exit(rc)


def _host() -> str:
    """``HOSTNAME (ADDRESS)``: the address the hostname resolves to, which gloo binds unless GLOO_SOCKET_IFNAME."""
    name = socket.gethostname()
    try:
        return f"{name} ({socket.gethostbyname(name)})"
    except OSError:
        return f"{name} (unresolved: gloo falls back to loopback)"


def _warnings_to(stream):
    def show(message, category, filename, lineno, file=None, line=None):
        stream.write(warnings.formatwarning(message, category, filename, lineno, line))
        stream.flush()

    return show


def failure_lines(run_dir: str | Path, exit_codes: dict[int, int], name=None) -> tuple[list[str], bool]:
    """One console line per distinct cause of a failed job, and whether every cause is a user error.

    ``exit_codes``: global rank -> exit code of the failed workers (negative = killed by that signal);
    ``name``: rank -> how the line names the process (default ``worker rank R``)."""
    import signal

    lines: list[str] = []
    all_user = bool(exit_codes)
    for rank in sorted(exit_codes):
        code = exit_codes[rank]
        who = name(rank) if name else f"worker rank {rank}"
        rel_log = Path(run_dir) / "logs" / f"rank-{rank}.log"
        rec = read_json(error_file(run_dir, rank))
        if rec and rec.get("kind") == "user":
            line = str(rec["message"])
        elif rec:
            all_user = False
            line = f"{who} failed: {rec['message']} (see {rel_log})"
        else:
            all_user = False
            if code < 0:
                try:
                    why = f"was killed by {signal.Signals(-code).name}"
                except ValueError:
                    why = f"was killed by signal {-code}"
            else:
                why = f"exited with code {code}"
            line = f"{who} {why} (see {rel_log})"
        if line not in lines:
            lines.append(line)
    return lines, all_user
