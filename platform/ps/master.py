"""The master of a parameter-server job: starts the S servers + W workers through torchrun's launcher
(torch.distributed.run), supervises them, and collects the workers' counters.

- Failure of any process (a worker or a server, e.g. SIGKILL) makes torchrun stop the group and start it
  again (up to ``max_restarts`` times). TensorPipe RPC groups have a fixed membership, so the group restarts
  as a whole: the servers reload the last consistent checkpoint (``RUN/checkpoints/latest``), each worker
  resumes at the first step its shards have not applied, and training continues to the end.
- Counters: every worker appends JSON lines to ``RUN/counters/worker-W.jsonl`` (step, samples/s, loss,
  validation AUC, pull/push wait); the master merges the last record of each and the restart count into
  ``RUN/counters.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def torchrun_argv(
    nprocs: int, argv: list[str], max_restarts: int, nnodes: int = 1, rdzv: str = "", rdzv_id="ps"
):
    args = ["--nnodes", str(nnodes), "--nproc-per-node", str(nprocs), "--max-restarts", str(max_restarts)]
    args += ["--monitor-interval", "0.5"]
    if nnodes == 1 and not rdzv:
        args += ["--standalone"]
    else:
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", rdzv_id]
    return [*args, "-m", "mariana.platform.cli", *argv]


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
    return out


def run_job(
    nprocs: int,
    argv: list[str],
    run_dir: str,
    max_restarts: int,
    nnodes=1,
    rdzv="",
    rdzv_id="ps",
    console_rank: int = 0,
) -> int:
    """Run the job under torchrun; returns 0 on success, 1 if it failed after all restarts (2 if every
    failed process reported bad input). ``console_rank``: the global rank whose progress bar and console
    log lines reach the terminal (e.g. the first worker, rank S); the others write only to their logs."""
    from ..core.atomic import atomic_write_text
    from ..dp.launch import run_torchrun
    from ..dp.workerio import failure_lines

    print(
        f"mariana: parameter-server job: {nprocs} process(es) on this node through torchrun "
        f"(max restarts {max_restarts})",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.time()
    rc = 0
    # Ctrl-C raises KeyboardInterrupt here (the CLI prints `mariana: interrupted`, exit 130); process
    # output goes to RUN/logs/rank-R.log, the console gets one line per cause of a failure.
    failure = run_torchrun(
        torchrun_argv(nprocs, argv, max_restarts, nnodes, rdzv, rdzv_id), run_dir, nprocs, console_rank
    )
    if failure is not None:
        codes = {int(r): f.exitcode for r, f in failure.failures.items()}
        lines, all_user = failure_lines(run_dir, codes)
        print(
            f"mariana: error: the job failed after {max_restarts} restart(s); exit codes by rank: {codes}",
            file=sys.stderr,
        )
        for line in lines:
            print(f"mariana: error: {line}", file=sys.stderr)
        rc = 2 if all_user else 1
    counters = collect_counters(run_dir)
    counters["wall_s"] = round(time.time() - t0, 2)
    if Path(run_dir).is_dir():
        atomic_write_text(Path(run_dir) / "counters.json", json.dumps(counters, indent=2, default=str) + "\n")
    return rc
