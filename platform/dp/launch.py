"""Start a job's worker processes through torchrun's launcher (torch.distributed.run).

``mariana <app> train --workers N ...`` runs in a plain process first; `launch_if_needed` re-executes the
same command line as ``python -m mariana.platform.cli <argv>`` in N torchrun workers. Inside a worker it
returns None and training proceeds. Single node: c10d rendezvous on a free loopback port (``--standalone``).
Multi-node: every node runs the same command with ``--nnodes M --rdzv-endpoint HOST:PORT`` (or runs
``torchrun ... -m mariana.platform.cli <app> train ...`` directly); torchrun's c10d rendezvous joins them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..core.config import TrainConfig

CLI_MODULE = "mariana.platform.cli"


def in_worker() -> bool:
    """True inside a process started by torchrun (or any launcher that sets RANK/WORLD_SIZE)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def needs_launcher(cfg: TrainConfig) -> bool:
    return cfg.workers > 1 or cfg.nnodes > 1 or cfg.max_restarts > 0


def torchrun_args(cfg: TrainConfig, argv: list[str], module: str = CLI_MODULE) -> list[str]:
    args = [
        "--nnodes",
        str(cfg.nnodes),
        "--nproc-per-node",
        str(cfg.workers),
        "--max-restarts",
        str(cfg.max_restarts),
    ]
    args += ["--monitor-interval", "0.5"]
    if cfg.nnodes == 1 and not cfg.rdzv_endpoint:
        args += ["--standalone"]
    else:
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", cfg.rdzv_endpoint, "--rdzv-id", cfg.rdzv_id]
    return [*args, "-m", module, *argv]


def stall_reports(run_dir: str | Path) -> list[dict]:
    logs = Path(run_dir) / "logs"
    out = []
    for p in sorted(logs.glob("stall-rank-*.json")) if logs.is_dir() else []:
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            pass
    return out


def worker_threads(nproc_per_node: int) -> int:
    """CPU threads per worker when ``nproc_per_node`` processes share this machine (at least 1):
    more would oversubscribe the cores."""
    return max(1, (os.cpu_count() or 1) // max(1, nproc_per_node))


def _quiet_launcher_logs(run_dir: Path) -> None:
    """torchrun's agent logs (restarts, failures, signals) go to ``RUN/logs/launcher.log``, not the
    console: the launcher prints its own one-line summary."""
    import logging

    handler = logging.FileHandler(run_dir / "logs" / "launcher.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        lg = logging.getLogger(name)
        lg.propagate = False
        lg.addHandler(handler)


def run_torchrun(args: list[str], run_dir: str | Path, nproc_per_node: int, console_rank: int = 0):
    """Run torchrun's launcher in this process with ``args`` (its command line); returns None on success
    or the ``ChildFailedError`` of a failed job. Ctrl-C (or SIGTERM) stops the workers and raises
    KeyboardInterrupt (the CLI prints ``mariana: interrupted``, exit 130).

    Workers get ``OMP_NUM_THREADS`` (unless set) and the run directory, so their output goes to
    ``RUN/logs/rank-R.log`` (see `workerio`); ``console_rank`` keeps its progress bar on the terminal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from .workerio import CONSOLE_RANK_ENV, RUN_DIR_ENV

    run_dir = Path(run_dir).absolute()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for stale in (run_dir / "logs").glob("error-rank-*.json"):  # of an earlier attempt of this run
        stale.unlink(missing_ok=True)
    if not os.environ.get("OMP_NUM_THREADS"):  # else torchrun sets 1 and prints a banner about it
        os.environ["OMP_NUM_THREADS"] = str(worker_threads(nproc_per_node))
    os.environ[RUN_DIR_ENV] = str(run_dir)
    os.environ[CONSOLE_RANK_ENV] = str(console_rank)
    _quiet_launcher_logs(run_dir)
    try:
        run(parse_args(args))
    except SignalException:
        raise KeyboardInterrupt from None
    except ChildFailedError as e:
        return e
    return None


def report_failure(e, run_dir: str | Path) -> int:
    """Print one console line per cause of a failed job (``e``: torchrun's ChildFailedError); returns
    the exit code: 2 when every failed worker reported bad input, else 1."""
    from .workerio import failure_lines

    codes = {int(r): f.exitcode for r, f in e.failures.items()}
    lines, all_user = failure_lines(run_dir, codes)
    for line in lines:
        print(f"mariana: error: {line}", file=sys.stderr)
    for rep in stall_reports(run_dir):
        print(
            f"mariana: error: watchdog on rank {rep['rank']}: no progress for {rep['timeout_s']:.0f}s; "
            f"stalled rank(s): {rep['stalled_ranks']} (see {run_dir}/logs/)",
            file=sys.stderr,
        )
    return 2 if all_user else 1


def launch_if_needed(cfg: TrainConfig, argv: list[str], module: str = CLI_MODULE) -> int | None:
    """In the user's process: run ``argv`` under torchrun and return the job's exit code.
    In a worker (or when one plain process suffices): return None, the caller trains in-process."""
    if in_worker() or not needs_launcher(cfg):
        return None
    print(
        f"mariana: launching {cfg.workers} worker(s) x {cfg.nnodes} node(s) through torchrun "
        f"(max restarts {cfg.max_restarts}); logs in {cfg.out}/logs/",
        file=sys.stderr,
        flush=True,
    )
    failure = run_torchrun(torchrun_args(cfg, argv, module), cfg.out, cfg.workers)
    return 0 if failure is None else report_failure(failure, cfg.out)
