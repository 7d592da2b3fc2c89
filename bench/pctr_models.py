"""Frappe side by side: our LR / FM / DNN / DeepFM / DCN against scikit-learn's LogisticRegression and
DeepCTR-Torch's DeepFM, all on the same 80/10/10 split by row order (test AUC and logloss).

Our models train in one process (`mariana.apps.pctr.train.train_local`, the same code as
`mariana pctr train --servers 0`) for ``--epochs`` epochs and are scored on the test split with the
serving `Predictor`. scikit-learn gets the one-hot design matrix of the same ids. DeepCTR-Torch (optional:
``.venv/bin/pip install deepctr-torch --no-deps``; its version check imports ``requests``, stubbed here
because it is not installed) gets the same per-field ids as label-encoded sparse features.

Usage: ``.venv/bin/python bench/pctr_models.py [--epochs 5] [--models lr,fm,dnn,deepfm,dcn]``
-> bench/results/pctr_models-cpu.json; the last line is the best model's test AUC.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
R = 8192  # rows per field: above Frappe's 5,382 ids, so no hash collisions and a fair comparison


def load_ids(path: str):
    from mariana.apps.pctr.data.encoding import Encoder, count_lines, infer_schema, load_split
    from mariana.platform.data.splits import split_bounds

    enc = Encoder(infer_schema(path, "libfm", R))
    b = split_bounds(count_lines(path), (0.8, 0.1, 0.1))
    out = {}
    for k in ("train", "val", "test"):
        x = load_split(path, enc, *b[k])
        out[k] = ((x.ids - torch.arange(x.ids.shape[1]) * R).numpy(), x.labels.numpy())
    return out


def ours(path: str, model: str, epochs: int, out: Path) -> dict:
    from mariana.apps.pctr.configs import PctrConfig
    from mariana.apps.pctr.evaluate import evaluate_run
    from mariana.apps.pctr.train import train_local

    run = out / model
    shutil.rmtree(run, ignore_errors=True)
    cfg = PctrConfig(
        data=path,
        out=str(run),
        format="libfm",
        model=model,
        epochs=epochs,
        rows_per_field=R,
        device="cpu",
        eval_every=0,
        early_stop=0,  # exactly --epochs, the final model (as the baselines get)
        l2_emb=0.0,  # the committed results' untuned model had no L2 (the default since is 0.01)
    )
    t0 = time.perf_counter()
    final = train_local(cfg)
    r = evaluate_run(str(run), path, "libfm", split="test")
    return {
        "auc": r["auc"],
        "logloss": r["logloss"],
        "val_auc": final["val_auc"],
        "train_s": round(time.perf_counter() - t0, 1),
    }


def sklearn_lr(d) -> dict:
    from scipy import sparse
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss, roc_auc_score

    def X(ids):
        n, f = ids.shape
        cols = (ids + np.arange(f) * R).ravel()
        return sparse.csr_matrix((np.ones(n * f), (np.repeat(np.arange(n), f), cols)), shape=(n, f * R))

    t0 = time.perf_counter()
    lr = LogisticRegression(C=1.0, max_iter=2000).fit(X(d["train"][0]), d["train"][1])
    p = lr.predict_proba(X(d["test"][0]))[:, 1]
    y = d["test"][1]
    return {
        "auc": roc_auc_score(y, p),
        "logloss": log_loss(y, p),
        "train_s": round(time.perf_counter() - t0, 1),
    }


def deepctr_deepfm(d, epochs: int) -> dict:
    sys.modules.setdefault("requests", types.ModuleType("requests"))  # only used by its version check
    from deepctr_torch.inputs import SparseFeat
    from deepctr_torch.models import DeepFM
    from sklearn.metrics import log_loss, roc_auc_score

    f = d["train"][0].shape[1]
    names = [f"f{i}" for i in range(f)]
    cols = [SparseFeat(n, vocabulary_size=R, embedding_dim=16) for n in names]
    model = DeepFM(cols, cols, task="binary", dnn_hidden_units=(256, 128), device="cpu", seed=0)
    model.compile("adam", "binary_crossentropy")

    def inp(ids):
        return {n: ids[:, i] for i, n in enumerate(names)}

    t0 = time.perf_counter()
    model.fit(inp(d["train"][0]), d["train"][1], batch_size=512, epochs=epochs, verbose=0)
    p = model.predict(inp(d["test"][0]), batch_size=4096).ravel()
    y = d["test"][1]
    return {
        "auc": roc_auc_score(y, p),
        "logloss": log_loss(y, p),
        "train_s": round(time.perf_counter() - t0, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--data", default=str(ROOT.parent / "shared/data/frappe/frappe.validation.libfm"), help="Frappe"
    )
    ap.add_argument("--epochs", type=int, default=5, help="training epochs of every neural model")
    ap.add_argument("--models", default="lr,fm,dnn,deepfm,dcn", help="our models to train")
    ap.add_argument("--out", default="runs/pctr-models", help="run directories of our models")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    d = load_ids(args.data)
    res: dict[str, dict] = {}
    for m in args.models.split(","):
        res[m] = ours(args.data, m, args.epochs, Path(args.out))
        print(f"{m:16s} AUC {res[m]['auc']:.4f} logloss {res[m]['logloss']:.4f}", flush=True)
    res["sklearn_lr"] = sklearn_lr(d)
    print(f"{'sklearn_lr':16s} AUC {res['sklearn_lr']['auc']:.4f}", flush=True)
    try:
        res["deepctr_deepfm"] = deepctr_deepfm(d, args.epochs)
        print(f"{'deepctr_deepfm':16s} AUC {res['deepctr_deepfm']['auc']:.4f}", flush=True)
    except ImportError as e:
        res["deepctr_deepfm"] = {"error": f"DeepCTR-Torch not installed ({e})"}
    res = {
        k: {kk: (float(vv) if isinstance(vv, float | np.floating) else vv) for kk, vv in v.items()}
        for k, v in res.items()
    }
    path = write_result(
        "pctr_models",
        {"benchmark": "pctr_models", "split": "80/10/10 by order", "epochs": args.epochs, "results": res},
    )
    scored = {k: v["auc"] for k, v in res.items() if "auc" in v}
    best = max(scored, key=scored.get)
    print(f"results in {path}")
    print(f"best test AUC {scored[best]:.4f} ({best})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
