"""The demo's measured figures over several seeds: how far one run's number is from another's.

`scripts/demo.sh` (`make demo`) runs each job once, with seed 0. This runs the demo's measured parts with
the demo's own settings and ``--seed S`` for each seed (data preparation keeps the demo's seed: the data
stay the same), reads each part's headline figure from its last output line, prints one table (min /
median / max per figure) and writes ``bench/results/demo_spread-{cpu,gpu}.json`` (machine, versions,
date, commit, command, every run's figure). The README's "The demo" section quotes the spread from it.

    python bench/demo_spread.py                      # every part, seeds 0 1 2
    python bench/demo_spread.py --parts mlp,pctr     # some parts (names: see PARTS)
    python bench/demo_spread.py --isa avx2 --seeds 0 # as on a CPU without AVX-512 -> demo_spread_isa-avx2

``--isa`` caps the vector instructions torch's kernels, MKL and oneDNN use (``ATEN_CPU_CAPABILITY``,
``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``): the part of a CPU model that picks the kernels, so two
CPU models' figures can be compared on one machine (same seed, same data, only the kernels differ).

Each part runs as the demo runs it (``python -m mariana.platform.cli``, 2 workers where the demo has
them), so a run takes the demo's time per seed (about 6 min on 2 CPU cores for every part)."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import table, write_result

DATA = "../shared/data"
FRAPPE = f"{DATA}/frappe/frappe.validation.libfm"
M = [sys.executable, "-m", "mariana.platform.cli"]

# part -> (figure name, the regex of its last line, [(command, ...)] with {run}/{seed}); the last command's
# last line holds the figure. Settings are scripts/demo.sh's.
PARTS = {
    "mlp": ("mlp test AUC", r"AUC (\d\.\d+)", [
        ["mlp", "train", "--data", FRAPPE, "--out", "{run}/mlp", "--workers", "2", "--epochs", "2",
         "--batch-size", "256", "--lr", "0.01", "--no-progress", "--seed", "{seed}"],
        ["mlp", "eval", "--model", "{run}/mlp", "--data", FRAPPE, "--split", "test"]]),
    "vision": ("vision small top-1 %", r"top-1 (\d+\.\d+)", [
        ["vision", "train", "--data", f"{DATA}/cifar10/train.tar", "--eval-data", f"{DATA}/cifar10/test-dev.tar",
         "--out", "{run}/vision", "--preset", "small", "--limit", "16000", "--workers", "2", "--no-progress",
         "--seed", "{seed}"],
        ["vision", "eval", "--model", "{run}/vision", "--data", f"{DATA}/cifar10/test-dev.tar"]]),
    "pipeline": ("vision 2-stage pipeline top-1 %", r"top-1 (\d+\.\d+)", [
        ["vision", "train", "--data", f"{DATA}/cifar10/train.tar", "--out", "{run}/pipe", "--preset", "small",
         "--limit", "8192", "--workers", "2", "--model-parallel", "2", "--micro-batches", "4",
         "--stage-balance", "time", "--no-progress", "--seed", "{seed}"],
        ["vision", "eval", "--model", "{run}/pipe", "--data", f"{DATA}/cifar10/test-dev.tar"]]),
    "asr": ("ASR small WER %", r"WER (\d+\.\d+)", [
        ["asr", "prepare", "--data", f"{DATA}/fsdd/recordings", "--out", "{run}/asr-data", "--test-speakers",
         "jackson", "--utterances", "150", "--max-digits", "5", "--force"],
        ["asr", "train", "--data", "{run}/asr-data", "--out", "{run}/asr", "--preset", "small", "--workers", "2",
         "--no-progress", "--seed", "{seed}"],
        ["asr", "eval", "--model", "{run}/asr", "--data", "{run}/asr-data/test"]]),
    "pctr": ("pCTR DeepFM 2 servers + 2 async workers test AUC", r"AUC (\d\.\d+)", [
        ["pctr", "train", "--data", FRAPPE, "--format", "libfm", "--out", "{run}/pctr", "--model", "deepfm",
         "--rows-per-field", "8192", "--dim", "8", "--hidden", "64,32", "--servers", "2", "--workers", "2",
         "--epochs", "2", "--ckpt-every", "40", "--no-progress", "--seed", "{seed}"],
        ["pctr", "eval", "--model", "{run}/pctr", "--data", FRAPPE, "--format", "libfm", "--split", "test"]]),
    "pctr-job": ("pCTR one-process job (--preset frappe, 3 epochs) validation AUC", r"validation AUC (\d\.\d+)", [
        ["pctr", "train", "--data", FRAPPE, "--format", "libfm", "--out", "{run}/job", "--preset", "frappe",
         "--epochs", "3", "--eval-every", "30", "--no-progress", "--seed", "{seed}"]]),
}  # fmt: skip


ISA_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
}


def run_part(name: str, seed: int, work: Path, env: dict | None = None) -> tuple[float, float]:
    """(the part's figure, seconds) for one seed; a failed command stops the bench with its output."""
    _, pattern, commands = PARTS[name]
    t0, last = time.perf_counter(), ""
    for cmd in commands:
        argv = [a.format(run=work / f"{name}-{seed}", seed=seed) for a in cmd]
        p = subprocess.run([*M, *argv], capture_output=True, text=True, env={**os.environ, **(env or {})})
        if p.returncode:
            sys.exit(f"demo_spread: {' '.join(argv)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        last = (p.stdout.strip().splitlines() or [""])[-1]
    m = re.search(pattern, last)
    if not m:
        sys.exit(f"demo_spread: {name}: no figure in its last line {last!r}")
    return float(m.group(1)), time.perf_counter() - t0


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), or the platform's machine name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.machine()


def readme_rows(path: Path) -> list[str]:
    """The README's spread table (markdown rows) from a result file: one row per part."""
    rows = ["| figure | min | median | max | seeds |", "|---|---|---|---|---|"]
    for r in json.loads(path.read_text())["results"]:
        seeds = ", ".join(str(s) for s in r["seeds"])
        rows.append(f"| {r['figure']} | {r['min']:g} | {r['median']:g} | {r['max']:g} | {seeds} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated parts of: {', '.join(PARTS)}")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument(
        "--isa", choices=sorted(ISA_ENV), help="cap the kernels' vector instructions (see the top)"
    )
    args = ap.parse_args()
    parts, seeds = args.parts.split(","), [int(s) for s in args.seeds.split(",")]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    rows, results = [], []
    with tempfile.TemporaryDirectory(prefix="demo-spread-") as tmp:
        for name in parts:
            values, seconds = [], []
            for seed in seeds:  # seeds in turn within a part: the machine's load moves between parts
                v, s = run_part(name, seed, Path(tmp), ISA_ENV.get(args.isa))
                values.append(v)
                seconds.append(round(s, 1))
                print(f"{name} seed {seed}: {v} ({s:.0f} s)", flush=True)
            spread = {"min": min(values), "median": statistics.median(values), "max": max(values)}
            results.append({"part": name, "figure": PARTS[name][0], "seeds": seeds, "values": values,
                            "seconds": seconds, **spread})  # fmt: skip
            rows.append({"figure": PARTS[name][0], **spread, "values": " ".join(f"{x:g}" for x in values)})
            name_ = f"demo_spread_isa-{args.isa}" if args.isa else "demo_spread"
            path = write_result(name_, {"isa": args.isa or "default", "results": results})  # after each part
    print(table(rows, ["figure", "min", "median", "max", "values"]))
    print(path)


if __name__ == "__main__":
    main()
