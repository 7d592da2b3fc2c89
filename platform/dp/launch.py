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


def launch_if_needed(cfg: TrainConfig, argv: list[str], module: str = CLI_MODULE) -> int | None:
    """In the user's process: run ``argv`` under torchrun and return the job's exit code.
    In a worker (or when one plain process suffices): return None, the caller trains in-process."""
    if in_worker() or not needs_launcher(cfg):
        return None
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    print(
        f"mariana: launching {cfg.workers} worker(s) x {cfg.nnodes} node(s) through torchrun "
        f"(max restarts {cfg.max_restarts})",
        file=sys.stderr,
        flush=True,
    )
    try:
        run(parse_args(torchrun_args(cfg, argv, module)))
    except ChildFailedError as e:
        codes = {f.local_rank if hasattr(f, "local_rank") else r: f.exitcode for r, f in e.failures.items()}
        print(f"mariana: error: the job failed; worker exit codes by rank: {codes}", file=sys.stderr)
        for rep in stall_reports(cfg.out):
            print(
                f"mariana: error: watchdog on rank {rep['rank']}: no progress for {rep['timeout_s']:.0f}s; "
                f"stalled rank(s): {rep['stalled_ranks']} (see {cfg.out}/logs/)",
                file=sys.stderr,
            )
        return 2 if codes and all(c == 2 for c in codes.values()) else 1
    return 0
