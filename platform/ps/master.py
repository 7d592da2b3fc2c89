"""The master of a parameter-server job: starts the S servers + W workers through the platform's one
launcher (`mariana.platform.runtime.launch.launch`, torchrun's agent), which restarts the whole group on a
failure (the servers reload ``RUN/checkpoints/latest``, each worker resumes at the first step its shards
have not applied) and names a failed process by its role. Counters: every worker appends JSON lines to
``RUN/counters/worker-W.jsonl``, every server writes ``RUN/counters/server-S.json``; the master merges the
last record of each worker, the servers' counters and the restart count into ``RUN/counters.json``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from ..core.atomic import atomic_write_text
from ..runtime.launch import launch


def collect_counters(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    out: dict = {"workers": {}, "restarts": 0}
    for p in sorted((run_dir / "counters").glob("worker-*.jsonl")):
        recs = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        if not recs:
            continue
        last = recs[-1]
        evals = [r for r in recs if "val_auc" in r]
        out["workers"][p.stem] = {
            "records": len(recs),
            "last": last,
            "val_auc": evals[-1]["val_auc"] if evals else None,
            "attempts": sorted({r.get("attempt", 0) for r in recs}),
        }
        out["restarts"] = max(out["restarts"], max(r.get("attempt", 0) for r in recs))
    for p in sorted((run_dir / "counters").glob("server-*.json")):
        out.setdefault("servers", {})[p.stem] = json.loads(p.read_text())
        out["restarts"] = max(out["restarts"], int(out["servers"][p.stem].get("attempt", 0)))
    return out


def role_name(num_servers: int) -> Callable[[int], str]:
    """rank -> ``server S (rank R)`` / ``worker W (rank R)`` (ranks ``0..S-1`` are the servers)."""

    def name(rank: int) -> str:
        if rank < num_servers:
            return f"server {rank} (rank {rank})"
        return f"worker {rank - num_servers} (rank {rank})"

    return name


def run_job(nprocs: int, argv: list[str], run_dir: str, ps, **how) -> int:
    """Run the job's ``nprocs`` processes on this node under the launcher (``ps``: its `launch.launch_config`
    section); returns 0, or 1 if it failed after all restarts (2 if every failed process reported bad input).
    ``how``: `launch`'s ``console_rank`` (the global rank whose bar and console lines reach the terminal, e.g.
    rank S) and ``progress``."""
    t0 = time.time()
    what = f"a parameter-server job: {ps.servers} server(s) + {ps.workers} worker(s)"
    rc = launch(nprocs, argv, run_dir, ps, what=what, name=role_name(ps.servers), **how)
    counters = collect_counters(run_dir)
    counters["wall_s"] = round(time.time() - t0, 2)
    if Path(run_dir).is_dir():
        atomic_write_text(Path(run_dir) / "counters.json", json.dumps(counters, indent=2, default=str) + "\n")
    return rc
