"""Freshness on drifting click logs: next-day AUC of a model frozen after day 1, an incrementally updated
model and a model retrained from scratch every day, and the training time of the last two.

The data is the drifting click-log generator's (`mariana pctr drift-logs`, apps/pctr/data/drift.py): ``--days``
days of ``--rows-per-day`` impressions where a quarter of the ads are new each day, a share of the users is
new and click rates drift. For each day d = 2..days, day d is scored (`evaluate_run`, what
`mariana pctr eval` runs) by

- **frozen**: the model trained on day 1 only;
- **incremental**: day 1's model, then one run per following day on that day's file only, continuing the
  previous run's whole training state (`--init-from PREV --init-train-state`), up to day d - 1;
- **scratch**: a model trained from scratch on days 1..d-1 (the list of files as ``--data``).

Every run makes one pass over its rows (``--epochs 1``, no validation: ``--split 1,0,0``), with the same
model, seed and settings, so incremental and scratch see every row once, in the same order (they are the
same computation up to batch boundaries at the ends of days; the point is the cost). Training seconds are
the wall time of `train_local` (what `mariana pctr train --servers 0` runs after parsing its flags),
including reading the text, writing the checkpoint and exporting the model; CPU seconds are the process's
CPU time over the same call (all threads), less sensitive to other jobs on a shared machine.

Usage: ``.venv/bin/python bench/pctr_freshness.py [--rows-per-day 100000] [--days 7]``
-> prints one table, writes bench/results/pctr_freshness-cpu.json. Scratch files go to ``--work``
(deleted at the end unless ``--keep``).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--days", type=int, default=7)
    ap.add_argument("--rows-per-day", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0, help="generator seed (training uses --train-seed)")
    ap.add_argument("--train-seed", type=int, default=0)
    ap.add_argument("--drift", type=float, default=None, help="generator --drift (default: the generator's)")
    ap.add_argument("--new-ads", type=float, default=None, help="generator --new-ads")
    ap.add_argument("--ads", type=int, default=None, help="generator --ads")
    ap.add_argument("--model", default="deepfm")
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--hidden", default="64,32")
    ap.add_argument("--rows-per-field", type=int, default=1 << 15)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--sparse-lr", type=float, default=0.05)
    ap.add_argument("--lr", type=float, default=0.005, help="dense learning rate (Adam)")
    ap.add_argument("--work", default="/tmp/pctr_freshness")
    ap.add_argument("--keep", action="store_true", help="keep the generated days and runs in --work")
    args = ap.parse_args()

    from mariana.apps.pctr.configs import PctrConfig
    from mariana.apps.pctr.data.drift import DriftSettings, day_name, generate
    from mariana.apps.pctr.evaluate import evaluate_run
    from mariana.apps.pctr.train import train_local

    logging.getLogger("mariana").setLevel(logging.WARNING)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    gen = {
        k: v
        for k, v in (("drift", args.drift), ("new_ads", args.new_ads), ("ads", args.ads))
        if v is not None
    }
    settings = DriftSettings(days=args.days, rows_per_day=args.rows_per_day, seed=args.seed, **gen)
    t0 = time.perf_counter()
    facts = generate(work / "days", settings)
    gen_s = time.perf_counter() - t0
    day = {d: str(work / "days" / day_name(d)) for d in range(1, args.days + 1)}

    def train(data: str, out: Path, init_from: str = "") -> tuple[float, float]:
        """Train one run; (wall seconds, CPU seconds of this process, all threads)."""
        cfg = PctrConfig(
            data=data,
            out=str(out),
            format="criteo",
            model=args.model,
            dim=args.dim,
            hidden=args.hidden,
            rows_per_field=args.rows_per_field,
            batch_size=args.batch_size,
            sparse_lr=args.sparse_lr,
            lr=args.lr,
            split="1,0,0",
            epochs=1,
            seed=args.train_seed,
            progress=False,
            init_from=init_from,
            init_train_state=bool(init_from),
        )
        t, c = time.perf_counter(), time.process_time()
        train_local(cfg)
        return time.perf_counter() - t, time.process_time() - c

    def auc(run: Path, d: int) -> float:
        return float(evaluate_run(str(run), day[d], out=run / "eval" / f"day-{d:02d}.json")["auc"])

    rows = []
    inc = {1: work / "inc-01"}
    t_first = train(day[1], inc[1])
    print(f"day 1 trained in {t_first[0]:.1f} s", flush=True)
    for d in range(2, args.days + 1):
        if d > 2:  # incremental: yesterday's model continued on yesterday's file
            inc[d - 1] = work / f"inc-{d - 1:02d}"
            t_inc = train(day[d - 1], inc[d - 1], init_from=str(inc[d - 2]))
        else:
            t_inc = t_first
        scratch = work / f"scratch-{d - 1:02d}"
        t_scr = train(",".join(day[k] for k in range(1, d)), scratch)
        r = {
            "day": d,
            "frozen_auc": auc(inc[1], d),
            "incremental_auc": auc(inc[d - 1], d),
            "scratch_auc": auc(scratch, d),
            "incremental_train_s": t_inc[0],
            "scratch_train_s": t_scr[0],
            "incremental_cpu_s": t_inc[1],
            "scratch_cpu_s": t_scr[1],
            "oracle_auc": facts[d - 1]["oracle_auc"],
            "new_ad_traffic": facts[d - 1]["new_ad_traffic"],
        }
        r["speedup"] = t_scr[0] / t_inc[0]
        r["speedup_cpu"] = t_scr[1] / t_inc[1]
        rows.append(r)
        print(
            f"day {d}: AUC frozen {r['frozen_auc']:.4f} incremental {r['incremental_auc']:.4f} "
            f"scratch {r['scratch_auc']:.4f}; train s incremental {t_inc[0]:.1f} scratch {t_scr[0]:.1f} "
            f"(CPU s {t_inc[1]:.1f} / {t_scr[1]:.1f})",
            flush=True,
        )
        if not args.keep:
            shutil.rmtree(scratch)
            if d - 2 > 1:
                shutil.rmtree(inc.pop(d - 2))

    mean = {k: float(np.mean([r[k] for r in rows])) for k in ("frozen_auc", "incremental_auc", "scratch_auc")}
    shown = [
        {
            "day": r["day"],
            "frozen": f"{r['frozen_auc']:.4f}",
            "incremental": f"{r['incremental_auc']:.4f}",
            "scratch": f"{r['scratch_auc']:.4f}",
            "oracle": f"{r['oracle_auc']:.4f}",
            "inc s": f"{r['incremental_train_s']:.1f}",
            "scratch s": f"{r['scratch_train_s']:.1f}",
            "speed-up": f"{r['speedup']:.1f}x",
            "inc cpu s": f"{r['incremental_cpu_s']:.1f}",
            "scratch cpu s": f"{r['scratch_cpu_s']:.1f}",
            "cpu speed-up": f"{r['speedup_cpu']:.1f}x",
        }
        for r in rows
    ]
    shown.append(
        {
            "day": "mean",
            "frozen": f"{mean['frozen_auc']:.4f}",
            "incremental": f"{mean['incremental_auc']:.4f}",
            "scratch": f"{mean['scratch_auc']:.4f}",
            "oracle": f"{np.mean([r['oracle_auc'] for r in rows]):.4f}",
        }
    )
    cols = ["day", "frozen", "incremental", "scratch", "oracle", "inc s", "scratch s", "speed-up"]
    cols += ["inc cpu s", "scratch cpu s", "cpu speed-up"]
    print(table(shown, cols))
    cmd = "python bench/pctr_freshness.py " + " ".join(sys.argv[1:])
    path = write_result(
        "pctr_freshness",
        {
            "command": cmd.strip(),
            "generator": {**settings.__dict__, "seconds": gen_s},
            "training": {
                "model": args.model,
                "dim": args.dim,
                "hidden": args.hidden,
                "rows_per_field": args.rows_per_field,
                "batch_size": args.batch_size,
                "sparse_lr": args.sparse_lr,
                "lr": args.lr,
                "epochs": 1,
                "seed": args.train_seed,
            },
            "days": rows,
            "mean": mean,
            "day1_train_s": t_first[0],
            "day1_cpu_s": t_first[1],
        },
    )
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(f"results in {path}")
    last = rows[-1]
    print(
        f"mean next-day AUC: incremental {mean['incremental_auc']:.4f} vs frozen {mean['frozen_auc']:.4f} "
        f"vs scratch {mean['scratch_auc']:.4f}; day {last['day']}: incremental trains {last['speedup']:.1f}x "
        f"faster than scratch ({last['speedup_cpu']:.1f}x in CPU seconds)"
    )


if __name__ == "__main__":
    main()
