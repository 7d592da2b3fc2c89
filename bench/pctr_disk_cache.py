"""Peak RSS and wall time of pCTR training with the encoded rows on disk vs in RAM (issue 32, Deliver 4).

A generated Criteo file (``--rows`` lines, `pctr_throughput.generate`: 13 geometric counts, 26 Zipf-drawn
categoricals) is trained on by ``mariana pctr train`` (DeepFM, dim 16, one process, ``--split 1,0,0``,
``--epochs``) twice per round, interleaved: ``disk`` with ``--cache-gb`` ``--small-gb`` (the rows go to
memory-mapped shards under RUN/row-cache/ and later epochs read them there) and ``ram`` with the default
``--cache-gb`` (a quarter of the machine's RAM: the rows stay in memory, as before the disk tier). Each run
is a child process that reports its own peak RSS (``ru_maxrss``); wall time is the child's whole run
(start-up, parsing, training, export). One table; JSON in bench/results/pctr_disk_cache-cpu.json.

Usage: ``.venv/bin/python bench/pctr_disk_cache.py --rows 4000000`` (the generated file, about 1 GB per 4M
rows, is deleted at the end unless ``--keep-data``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_result  # noqa: E402
from pctr_throughput import generate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROW_BYTES = 39 * 8 + 39 * 4 + 13 * 4 + 4  # an encoded Criteo row: ids int64, vals, dense, label float32
_MEASURE = (
    "import resource, sys\n"
    "from mariana.platform.cli.main import main\n"
    "rc = main(sys.argv[1:])\n"
    "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    "sys.exit(rc)\n"
)


def run_once(args, data: Path, out: Path, cache_gb: float | None) -> dict:
    """One training run in a child process -> {peak_rss_gb, wall_s, samples_per_s, row_cache}."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        "pctr", "train", "--data", str(data), "--out", str(out), "--format", "criteo", "--model", "deepfm",
        "--dim", "16", "--rows-per-field", str(args.rows_per_field), "--batch-size", str(args.batch_size),
        "--split", "1,0,0", "--epochs", str(args.epochs), "--no-progress",
    ]  # fmt: skip
    if cache_gb is not None:
        cmd += ["--cache-gb", str(cache_gb)]
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"run failed ({p.returncode}): {p.stderr[-3000:]}")
    final = json.loads((out / "metrics.json").read_text())
    rss_kb = int(p.stdout.split("PEAK_RSS_KB")[1].split()[0])
    shutil.rmtree(out, ignore_errors=True)
    return {
        "peak_rss_gb": round(rss_kb * 1024 / 1e9, 3),
        "wall_s": round(wall, 1),
        "samples_per_s": round(final.get("samples_per_s", 0.0)),
        "row_cache": final.get("row_cache"),
        "command": "mariana " + " ".join(cmd),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="runs/bench-disk-cache/criteo_synth.tsv", help="generated file")
    ap.add_argument("--rows", type=int, default=4_000_000, help="generated lines (if --data is missing)")
    ap.add_argument("--rows-per-field", type=int, default=100_000)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--small-gb", type=float, default=0.05, help="--cache-gb of the disk runs")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds (disk, ram)")
    ap.add_argument("--keep-data", action="store_true")
    args = ap.parse_args()
    data = ROOT / args.data
    data.parent.mkdir(parents=True, exist_ok=True)
    if not data.exists():
        print(f"generating {args.rows} lines into {data} ...", flush=True)
        generate(data, args.rows, args.rows_per_field, 1.1)
    lines = sum(1 for _ in open(data, "rb"))
    rows = []
    try:
        for r in range(args.rounds):
            for name, gb in (("disk", args.small_gb), ("ram", None)):
                res = run_once(args, data, data.parent / f"run-{name}", gb)
                rows.append(
                    {"round": r, "config": name, "cache_gb": gb if gb is not None else "default", **res}
                )
                print({k: v for k, v in rows[-1].items() if k != "command"}, flush=True)
    finally:
        size = data.stat().st_size
        if not args.keep_data:
            shutil.rmtree(data.parent, ignore_errors=True)
    print(table(rows, ["round", "config", "cache_gb", "row_cache", "peak_rss_gb", "wall_s", "samples_per_s"]))
    path = write_result(
        "pctr_disk_cache",
        {
            "data": {"lines": lines, "text_bytes": size, "encoded_bytes": lines * ROW_BYTES},
            "settings": {k: v for k, v in vars(args).items() if k not in ("keep_data",)},
            "runs": rows,
            "usage": "python bench/pctr_disk_cache.py " + " ".join(sys.argv[1:]),
            "commit": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
