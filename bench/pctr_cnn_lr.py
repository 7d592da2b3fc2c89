"""CNN image features + logistic regression for click prediction, on a documented semi-synthetic benchmark.

No public data set pairs ad images with clicks, so this one is built (seeded, reproducible):

- Creatives: ``--ads`` CIFAR-10 images from ``--images`` (default test-dev.tar, NOT the CNN's training
  images). Each ad also has an advertiser (``--advertisers``, uniform) and the image's class is its hidden
  "content" (never given to the click models).
- Users: ``--users`` users, each in one of ``--segments`` observable segments (a user field). A user's
  latent preference over the 10 content classes is theta_u = P[segment] + 0.5 * noise, P ~ N(0, 1.5^2).
- Impressions: ``--impressions`` (user, ad, position 0-3) drawn uniformly; click ~ Bernoulli(sigmoid(
  -1.5 + theta_u[content(ad)] + b_advertiser + b_position + b_segment)), b ~ N(0, 0.5^2).
- Split 80/20 by impression order.

Click models (scikit-learn LogisticRegression, sparse design matrix):
- ``without_images``: one-hot user id, segment, ad id, advertiser, position;
- ``with_images``: the same plus the CNN feature vector of the creative (penultimate activations of a
  trained vision CNN, PCA to ``--pca`` dims) and its cross with the segment one-hot (segment x image);
- ``oracle``: the same crosses with the true content class instead of CNN features (an upper bound).

The CNN is a `mariana vision train` run (``--cnn RUN``); without one, a small CNN is trained first with
``mariana vision train --preset small --limit 8000`` on ``--cnn-train`` (~2 min on 2 cores).

Usage: ``.venv/bin/python bench/pctr_cnn_lr.py --cnn runs/demo/vision`` -> bench/results/pctr_cnn_lr-cpu.json;
the last line is ``AUC without images 0.xxxx with images 0.xxxx``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy import sparse
from sklearn.decomposition import PCA
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import log_loss, roc_auc_score

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def cnn_features(run: str, images: torch.Tensor, batch: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """(penultimate features [N, D] float32, class probabilities [N, 10]) of uint8 images [N, 3, S, S]:
    the input of the CNN's last Linear layer is captured with a forward pre-hook."""
    from mariana.apps.vision.predict import load_classifier

    clf = load_classifier(run)
    last = [m for m in clf.model.modules() if isinstance(m, torch.nn.Linear)][-1]
    feats: list[torch.Tensor] = []
    hook = last.register_forward_pre_hook(lambda _m, inp: feats.append(inp[0].detach().flatten(1)))
    probs = []
    try:
        for i in range(0, len(images), batch):
            probs.append(clf.probabilities(images[i : i + batch]))
    finally:
        hook.remove()
    return torch.cat(feats).float().numpy(), torch.cat(probs).numpy()


def one_hot(idx: np.ndarray, n: int) -> sparse.csr_matrix:
    return sparse.csr_matrix((np.ones(len(idx)), (np.arange(len(idx)), idx)), shape=(len(idx), n))


def cross(seg_idx: np.ndarray, n_seg: int, dense: np.ndarray) -> sparse.csr_matrix:
    """Row i: the dense vector placed in block seg_idx[i] of n_seg blocks (segment x feature cross)."""
    n, d = dense.shape
    cols = seg_idx[:, None] * d + np.arange(d)[None, :]
    return sparse.csr_matrix(
        (dense.ravel(), (np.repeat(np.arange(n), d), cols.ravel())), shape=(n, n_seg * d)
    )


def fit_eval(X: sparse.csr_matrix, y: np.ndarray, n_train: int, C: float) -> dict:
    t0 = time.perf_counter()
    lr = LogisticRegression(C=C, max_iter=2000, solver="lbfgs")
    lr.fit(X[:n_train], y[:n_train])
    p = lr.predict_proba(X[n_train:])[:, 1]
    yt = y[n_train:]
    return {
        "auc": float(roc_auc_score(yt, p)),
        "logloss": float(log_loss(yt, p)),
        "features": int(X.shape[1]),
        "fit_s": round(time.perf_counter() - t0, 2),
    }


def main(argv=None) -> int:
    data = ROOT.parent / "shared" / "data" / "cifar10"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--data", default=str(data / "test-dev.tar"), help="creatives: CIFAR-10 tar (ImageFolder)"
    )
    ap.add_argument("--cnn", default="", help="run directory of `mariana vision train` (default: train one)")
    ap.add_argument(
        "--cnn-train", default=str(data / "train.tar"), help="images to train the CNN on if needed"
    )
    ap.add_argument("--out", default="runs/pctr-cnn-lr", help="where a CNN trained here is written")
    ap.add_argument("--ads", type=int, default=2000, help="creatives (images)")
    ap.add_argument("--users", type=int, default=1000, help="users")
    ap.add_argument("--segments", type=int, default=20, help="observable user segments")
    ap.add_argument("--advertisers", type=int, default=50, help="advertisers")
    ap.add_argument("--impressions", type=int, default=100_000, help="impressions (80%% train, 20%% test)")
    ap.add_argument("--pca", type=int, default=16, help="CNN feature dimensions kept (PCA)")
    ap.add_argument("--C", type=float, default=1.0, help="inverse L2 strength of LogisticRegression")
    ap.add_argument("--seed", type=int, default=0, help="seed of the generator")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))

    from mariana.apps.vision.data import decode_many, open_source

    cnn = args.cnn
    if not cnn:
        cnn = str(Path(args.out) / "cnn")
        if not (Path(cnn) / "model.safetensors").is_file():
            cmd = [sys.executable, "-m", "mariana.platform.cli", "vision", "train", "--data", args.cnn_train]
            cmd += ["--out", cnn, "--preset", "small", "--limit", "8000", "--no-progress"]
            print("training the CNN:", " ".join(cmd), file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, cwd=ROOT)

    rng = np.random.default_rng(args.seed)
    src = open_source(args.data)
    pick = np.sort(rng.choice(len(src), size=min(args.ads, len(src)), replace=False))
    images, bad = decode_many([src.read(int(i)) for i in pick], 32)
    keep = np.delete(pick, bad)
    content = src.labels[torch.from_numpy(keep)].numpy()
    n_ads = len(keep)
    t0 = time.perf_counter()
    feats, probs = cnn_features(cnn, images)
    cnn_s = time.perf_counter() - t0
    cnn_acc = float((probs.argmax(1) == content).mean())
    z = PCA(n_components=args.pca, random_state=args.seed).fit_transform(feats)
    z = (z / z.std(0, keepdims=True)).astype(np.float64)

    # --- the semi-synthetic click log
    K = 10
    seg_of_user = rng.integers(0, args.segments, args.users)
    pref = rng.normal(0, 1.5, (args.segments, K))
    theta = pref[seg_of_user] + 0.5 * rng.normal(0, 1, (args.users, K))
    adv_of_ad = rng.integers(0, args.advertisers, n_ads)
    b_adv, b_pos, b_seg = (rng.normal(0, 0.5, n) for n in (args.advertisers, 4, args.segments))
    u = rng.integers(0, args.users, args.impressions)
    a = rng.integers(0, n_ads, args.impressions)
    pos = rng.integers(0, 4, args.impressions)
    s = seg_of_user[u]
    logit = -1.5 + theta[u, content[a]] + b_adv[adv_of_ad[a]] + b_pos[pos] + b_seg[s]
    y = (rng.random(args.impressions) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    n_train = int(0.8 * args.impressions)

    base = sparse.hstack(
        [
            one_hot(u, args.users),
            one_hot(s, args.segments),
            one_hot(a, n_ads),
            one_hot(adv_of_ad[a], args.advertisers),
            one_hot(pos, 4),
        ]
    ).tocsr()
    img = z[a]
    with_img = sparse.hstack([base, sparse.csr_matrix(img), cross(s, args.segments, img)]).tocsr()
    true_c = np.eye(K)[content[a]]
    oracle = sparse.hstack([base, cross(s, args.segments, true_c)]).tocsr()
    res = {
        "without_images": fit_eval(base, y, n_train, args.C),
        "with_images": fit_eval(with_img, y, n_train, args.C),
        "oracle_content": fit_eval(oracle, y, n_train, args.C),
    }
    payload = {
        "benchmark": "pctr_cnn_lr",
        "setup": {k: v for k, v in vars(args).items()},
        "cnn": {"run": cnn, "creative_accuracy": cnn_acc, "feature_dim": int(feats.shape[1]), "s": cnn_s},
        "ctr": float(y.mean()),
        "results": res,
    }
    path = write_result("pctr_cnn_lr", payload)
    for k, v in res.items():
        print(f"{k:16s} AUC {v['auc']:.4f} logloss {v['logloss']:.4f} ({v['features']} features)")
    print(f"CNN accuracy on the creatives {cnn_acc:.3f}; CTR {y.mean():.3f}; results in {path}")
    print(
        f"AUC without images {res['without_images']['auc']:.4f} with images {res['with_images']['auc']:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
