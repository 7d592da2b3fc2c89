"""The wrapper every job runs under: ``python -m mariana.platform.jobs.runner --exit-file F -- argv...``.

It runs ``python -m mariana.platform.cli argv...`` as its child (same process group, so a group signal
reaches both), waits for it and writes the child's exit status to ``F`` atomically (temporary file +
rename). The service may have been restarted (or killed) in the meantime: the exit file is how a job that
ended while nobody was watching reports success or failure. Negative statuses are signals (-15 =
SIGTERM). Imports only the standard library, so it adds no start-up time to the job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def write_exit(path: str, code: int) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{code}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[0] != "--exit-file" or "--" not in argv:
        print(
            "usage: python -m mariana.platform.jobs.runner --exit-file F -- APP CMD [ARGS...]",
            file=sys.stderr,
        )
        return 2
    exit_file = argv[1]
    job_argv = argv[argv.index("--") + 1 :]
    try:
        os.unlink(exit_file)  # a retried job reuses the run directory: the old status is not ours
    except FileNotFoundError:
        pass
    # A cancel signals the whole group: the child gets it directly; this process stays to record the status.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    child = subprocess.Popen([sys.executable, "-m", "mariana.platform.cli", *job_argv])
    code = child.wait()
    write_exit(exit_file, code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
