"""The wrapper every local job runs under (`LocalExecutor`): a child of the service's fork server, which
imported torch and the commands once, not per job.

`run` starts a session of its own (so the job survives the service, and a group signal reaches the job
too), forks the job ``mariana argv...`` (`_job`, in its process group), waits for it and writes its exit
status to ``RUN/job.exit`` atomically. The service may have been restarted (or killed) in the meantime:
the exit file is how a job that ended while nobody was watching reports success or failure. Negative
statuses are signals (-15 = SIGTERM).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import traceback

from ..core.atomic import atomic_write_text
from ..runtime.launch import output_to, run_cli_module


def run(exit_file: str, argv: list[str], cwd: str, env: dict[str, str], log: str) -> None:
    """The job ``mariana argv`` in ``cwd`` with exactly ``env``, stdout and stderr appended to ``log``;
    exits with its status (a signal's as 128 + N) once that is in ``exit_file``."""
    os.setsid()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(exit_file)  # a retried job reuses the run directory: the old status is not ours
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    output_to(log, env)
    os.chdir(cwd or ".")
    # A cancel signals the whole group: the job gets it directly; this process stays to record the status.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    if (pid := os.fork()) == 0:
        _job(argv)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    atomic_write_text(exit_file, f"{code}\n")
    sys.exit(code if code >= 0 else 128 - code)


def _job(argv: list[str]) -> None:
    """``mariana argv`` in this forked process, ended as a fresh interpreter ends (non-daemon threads joined,
    atexit handlers run); never returns."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        run_cli_module(argv)
        code = 0
    except SystemExit as e:  # as the interpreter reads it: None is 0, a message is printed and 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        threading._shutdown()
        atexit._run_exitfuncs()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
