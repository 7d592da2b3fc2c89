"""The model-selection goal on Frappe: DeepFM and DCN-v2 tuned by `mariana tune` (the shipped spaces
``apps/pctr/spaces/{deepfm,dcn}.toml``) against untuned DeepFM, scikit-learn LR and DeepCTR-Torch DeepFM
(when installed), all scored on the same held-out test split.

Every trial trains on the 80 % train split of the sample file and is selected on its 10 % validation split
(``--split 0.8,0.1,0.1``, the pctr default); only the two studies' best models are scored on the 10 % test
split, which no trial saw. The budget (``--minutes``, default 30) is split evenly between the two studies
(``mariana tune --timeout``: no trial starts after it; the running ones finish). The baselines come from
``bench/pctr_models.py`` (same split, same rows).

The command sequence it runs (and documents)::

    mariana tune pctr --space apps/pctr/spaces/deepfm.toml --trials 1000 --timeout 900 --parallel 2 \\
        --out runs/tune-frappe/deepfm --data DATA --format libfm
    mariana pctr eval --model runs/tune-frappe/deepfm/best --data DATA --split test
    (the same for dcn.toml)
    mariana serve --pctr runs/tune-frappe/deepfm/best          # the tuned model behind the REST API

Usage: ``.venv/bin/python bench/tune_frappe.py [--minutes 30] [--parallel 2]``
-> bench/results/tune_frappe-cpu.json; the last line is the best tuned model's test AUC.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402
from pctr_models import deepctr_deepfm, load_ids, ours, sklearn_lr  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def mariana(*args: str) -> str:
    """Run ``mariana ARGS`` as a real process (output streamed); returns its last stdout line."""
    cmd = [sys.executable, "-m", "mariana.platform.cli", *map(str, args)]
    print("$ mariana " + " ".join(map(str, args)), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"mariana {' '.join(map(str, args))} failed with exit status {proc.returncode}")
    return [ln for ln in proc.stdout.splitlines() if ln.strip()][-1]


def tuned(model: str, data: str, out: Path, seconds: float, parallel: int) -> dict:
    tune_dir = out / model
    t0 = time.perf_counter()
    mariana("tune", "pctr", "--space", ROOT / "apps/pctr/spaces" / f"{model}.toml", "--trials", "1000",
            "--timeout", int(seconds), "--parallel", parallel, "--out", tune_dir, "--local",
            "--data", data, "--format", "libfm")  # fmt: skip
    wall = time.perf_counter() - t0
    mariana("pctr", "eval", "--model", tune_dir / "best", "--data", data, "--split", "test")
    ev = json.loads(next((tune_dir / "best" / "eval").glob("*-test.json")).read_text())
    res = json.loads((tune_dir / "results.json").read_text())
    states = [t["state"] for t in res["trials"]]
    return {
        "auc": ev["auc"],
        "logloss": ev["logloss"],
        "val_auc": res["best"]["value"],
        "best_params": res["best"]["params"],
        "trials": len(states),
        "complete": states.count("complete"),
        "pruned": states.count("pruned"),
        "failed": states.count("fail"),
        "tune_wall_s": round(wall, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--data", default=str(ROOT.parent / "shared/data/frappe/frappe.validation.libfm"), help="Frappe"
    )
    ap.add_argument("--minutes", type=float, default=30.0, help="tuning budget of both studies together")
    ap.add_argument("--parallel", type=int, default=2, help="trials in flight per study")
    ap.add_argument("--models", default="deepfm,dcn", help="shipped spaces to tune (apps/pctr/spaces)")
    ap.add_argument("--baseline-epochs", type=int, default=5, help="epochs of the untuned baselines")
    ap.add_argument("--out", default="runs/tune-frappe", help="study directories")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    models = args.models.split(",")
    res: dict[str, dict] = {}
    for m in models:
        res[f"tuned_{m}"] = tuned(m, args.data, out, args.minutes * 60 / len(models), args.parallel)
        print(f"tuned {m:10s} test AUC {res[f'tuned_{m}']['auc']:.4f}", flush=True)
    import torch

    torch.set_num_threads(2)
    res["untuned_deepfm"] = ours(args.data, "deepfm", args.baseline_epochs, out / "baselines")
    d = load_ids(args.data)
    res["sklearn_lr"] = sklearn_lr(d)
    try:
        res["deepctr_deepfm"] = deepctr_deepfm(d, args.baseline_epochs)
    except ImportError as e:
        res["deepctr_deepfm"] = {"error": f"DeepCTR-Torch not installed ({e})"}
    res = {
        k: {kk: (float(vv) if isinstance(vv, float | np.floating) else vv) for kk, vv in v.items()}
        for k, v in res.items()
    }
    for k, v in res.items():
        if "auc" in v:
            print(f"{k:16s} test AUC {v['auc']:.4f} logloss {v['logloss']:.4f}")
    path = write_result(
        "tune_frappe",
        {"benchmark": "tune_frappe", "split": "80/10/10 by order (tune on val, score on test)",
         "budget_minutes": args.minutes, "parallel": args.parallel, "results": res},
    )  # fmt: skip
    best = max((k for k in res if k.startswith("tuned_")), key=lambda k: res[k]["auc"])
    print(f"results in {path}")
    print(f"best tuned test AUC {res[best]['auc']:.4f} ({best})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
