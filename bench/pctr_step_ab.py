"""The one-process pCTR CPU step of this checkout against another revision's, interleaved (issue 42: the
step's consolidation must not make it slower). Each side is one long-lived process that builds the step
once (`pctr_cpu_floor.ours_loop`: what ``pctr train`` runs on a CPU, fp32, DeepFM on Criteo's layout,
batch 2048, Zipf 1.2 ids) and then times blocks of ``--steps`` steps on request, the two sides alternating
(the order flipping every round), so a load change on a shared machine hits both alike. Reported: wall and
CPU (process) ms per step, medians, and the median of the per-round ratios base / this (> 1: this faster).

    .venv/bin/python bench/pctr_step_ab.py --base 046a4d7 [--rounds 20] [--steps 10] [--rows-per-field 100000]

The base revision is unpacked (``git archive``) into a temporary folder and imported from there as
``mariana`` (its C loops build as that revision builds them). Writes ``bench/results/pctr_step_ab-cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def serve(bench: str, rows_per_field: int, steps: int) -> None:
    """One side: build the step, then per line on stdin time ``steps`` steps: prints 'wall_ms cpu_ms'."""
    sys.path.insert(0, bench)
    import torch
    from pctr_cpu_floor import make_batches, ours_loop

    torch.set_num_threads(1)
    batches = make_batches(rows_per_field, 2048, 8, 1.2)
    step = ours_loop(rows_per_field, "off")
    for b in batches[:5]:
        step(b)
    print("ready", flush=True)
    i = 0
    for _ in sys.stdin:
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step(batches[i % len(batches)])
            i += 1
        wall, cpu = (time.perf_counter() - w0) / steps * 1e3, (time.process_time() - c0) / steps * 1e3
        print(f"{wall:.2f} {cpu:.2f}", flush=True)


def base_tree(rev: str) -> tuple[Path, Path]:
    """(the revision's bench folder, a folder to put on PYTHONPATH that imports it as ``mariana``)."""
    tmp = Path(tempfile.mkdtemp(prefix="pctr-ab-"))
    tree, path = tmp / "tree", tmp / "path" / "mariana"
    tree.mkdir()
    path.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    for sub in ("platform", "apps", "serving"):
        (path / sub).symlink_to(tree / sub)
    return tree / "bench", path.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="main", help="the revision to compare with")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10, help="steps per block")
    ap.add_argument("--rows-per-field", type=int, default=100_000)
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # internal: one side's block timer
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve, args.rows_per_field, args.steps)
    bench, path = base_tree(args.base)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    envs = {
        "base": {**env, "PYTHONPATH": str(path), "MARIANA_KERNEL_CACHE": str(path.parent / "cache")},
        "this": env,
    }
    benches = {"base": str(bench), "this": str(ROOT / "bench")}
    procs = {}
    for side in ("base", "this"):
        cmd = [sys.executable, __file__, "--serve", benches[side], "--steps", str(args.steps)]
        cmd += ["--rows-per-field", str(args.rows_per_field)]
        procs[side] = subprocess.Popen(cmd, cwd=path.parent, env=envs[side], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert procs[side].stdout.readline().strip() == "ready", side
    blocks = {side: [] for side in procs}
    for r in range(args.rounds):
        for side in list(procs)[:: 1 if r % 2 == 0 else -1]:
            procs[side].stdin.write("go\n")
            procs[side].stdin.flush()
            blocks[side].append([float(x) for x in procs[side].stdout.readline().split()])
    for p in procs.values():
        p.stdin.close()
        p.wait()
    out = {"command": " ".join(sys.argv), "base": args.base, "rows_per_field": args.rows_per_field,
           "threads": 1, "steps_per_block": args.steps, "load_avg": os.getloadavg()}  # fmt: skip
    for i, unit in enumerate(("wall", "cpu")):
        for side, b in blocks.items():
            out[f"{side}_{unit}_ms_median"] = statistics.median(x[i] for x in b)
        ratios = [a[i] / b[i] for a, b in zip(blocks["base"], blocks["this"])]
        out[f"{unit}_ratio_base_over_this_median"] = round(statistics.median(ratios), 3)
    out["blocks"] = blocks
    res = ROOT / "bench" / "results" / "pctr_step_ab-cpu.json"
    res.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "blocks"}, indent=1))


if __name__ == "__main__":
    main()
