"""Our default DeepFM recipe against the published BARS/FuxiCTR Frappe recipe, on our split, 3 seeds each.

Issue 42 point 5: the default `mariana pctr train --model deepfm` (no tuning flags) must score at least the
published recipe (embedding 10, MLP 400-400-400 with batch norm, dropout 0.2, embedding regulariser 0.05, Adam
1e-3, batch 4096: `frappe_ceiling.bars_deepfm`, plain PyTorch outside our code) on the 80/10/10 row-order split of
the 57,722-row Frappe sample. Both sides select their model on validation (ours: early stop + the best validation
step exported; BARS: best-val weights, lr / 10 after a validation without improvement); both report test AUC. The
published test split of BARS stays out of this (the project's held-out check). Rounds are interleaved (BARS seed
s, ours seed s, ...), both on 2 threads.

Usage: ``.venv/bin/python bench/frappe_defaults.py [--seeds 3]`` -> bench/results/frappe_defaults-cpu.json;
``--no-bars --flags "--dropout 0.2"``: our side with flags over the defaults (the search behind them) ->
bench/results/frappe_defaults-search-cpu.json (each run overwrites it: the README quotes what it printed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402
from frappe_ceiling import bars_deepfm, load  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MARIANA = [sys.executable, "-m", "mariana.platform.cli"]


def ours(data: Path, seed: int, work: Path, flags: list[str]) -> dict:
    """`mariana pctr train` with its defaults, ``flags`` and ``--seed``, then `pctr eval --split test` -> AUCs."""
    run = work / f"ours-s{seed}"
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    t0 = time.perf_counter()
    subprocess.run(
        [
            *MARIANA,
            "pctr",
            "train",
            "--data",
            str(data),
            "--out",
            str(run),
            "--seed",
            str(seed),
            "--no-progress",
            *flags,
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    seconds = time.perf_counter() - t0
    subprocess.run(
        [*MARIANA, "pctr", "eval", "--model", str(run), "--data", str(data), "--split", "test"],
        check=True,
        env=env,
        capture_output=True,
    )
    test = json.loads(next((run / "eval").glob("*-test.json")).read_text())
    metrics = json.loads((run / "metrics.json").read_text())
    return {
        "seed": seed,
        "val_auc": metrics["best_eval_auc"],
        "auc": test["auc"],
        "best_step": metrics.get("best_step"),
        "seconds": round(seconds, 1),
    }


def summary(rows: list[dict]) -> dict:
    aucs = [r["auc"] for r in rows]
    return {"mean": statistics.mean(aucs), "min": min(aucs), "max": max(aucs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--data", default=str(ROOT.parent / "shared/data/frappe/frappe.validation.libfm"), help="Frappe libFM"
    )
    ap.add_argument("--seeds", type=int, default=3, help="seeds per side")
    ap.add_argument("--flags", default="", help="flags over our defaults (the search), e.g. '--dropout 0.2'")
    ap.add_argument("--no-bars", action="store_true", help="our side only (the search)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    x, y = load(Path(args.data))
    res: dict = {"bars_recipe": [], "ours_default": []}
    with tempfile.TemporaryDirectory() as work:
        for seed in range(args.seeds):
            t0 = time.perf_counter()
            if not args.no_bars:
                r = bars_deepfm(x, y, 10, "400,400,400", 0.2, 0.05, 4096, seed)
                r.update(seed=seed, seconds=round(time.perf_counter() - t0, 1))
                res["bars_recipe"].append(r)
            res["ours_default"].append(ours(Path(args.data), seed, Path(work), shlex.split(args.flags)))
            print(
                f"seed {seed}: " + "  ".join(f"{k} {v[-1]['auc']:.4f}" for k, v in res.items() if v),
                flush=True,
            )
    res = {k: v for k, v in res.items() if v}
    res["summary"] = {k: summary(v) for k, v in res.items()}
    res["flags"] = args.flags
    print(f"{'recipe (3 seeds, selected on val)':36s} {'mean':>7s} {'min':>7s} {'max':>7s}  test AUC")
    for k, s in res["summary"].items():
        print(f"{k:36s} {s['mean']:7.4f} {s['min']:7.4f} {s['max']:7.4f}")
    name = "frappe_defaults" + ("-search" if args.flags or args.no_bars else "")
    path = write_result(name, {"benchmark": "frappe_defaults", "split": "80/10/10 by order", "results": res})
    print(f"results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
