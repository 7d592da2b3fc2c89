"""CNN image features in click models (`mariana pctr train --image-features`), on a semi-synthetic creative set.

No public data set pairs ad images with clicks, so this one is built (seeded, reproducible) and written as a
real click log plus an images folder, then trained and scored with the real commands:

- Creatives: ``--ads`` CIFAR-10 images from ``--data`` (default test-dev.tar, NOT the CNN's training
  images), written as ``WORK/images/ad<j>.jpg``. Each ad has an advertiser (``--advertisers``, uniform); the
  image's class is its hidden "content" (never given to the click models except the oracle).
- Users: ``--users`` users, each in one of ``--segments`` observable segments. A user's latent preference
  over the 10 content classes is theta_u = P[segment] + 0.5 * noise, P ~ N(0, 1.5^2).
- Impressions: ``--impressions`` (user, ad, position 0-3) drawn uniformly; click ~ Bernoulli(sigmoid(
  -1.5 + theta_u[content(ad)] + b_advertiser + b_position + b_segment)), b ~ N(0, 0.5^2).
- Click log (Criteo TSV, counts empty): C1 user, C2 segment, C3 ad id (names its image), C4 advertiser,
  C5 position; the oracle's copy adds C6 = segment x true content class. Rows in impression order, split
  70/10/20 (train / validation for early stopping / test); AUC on the test 20 %.

Per ``--models`` (default lr, deepfm), three runs of `mariana pctr train` + `mariana pctr eval --split test`:
- ``without_images``: the log as is;
- ``with_images``: ``--image-features CNN --image-field C3 --images WORK/images`` (penultimate-layer
  features, PCA ``--image-dims``, whitened, as dense inputs);
- ``with_images_x_segment``: the same plus ``--image-cross C2`` (the features crossed with the segment:
  one weight vector per segment, what the previous scikit-learn version of this benchmark did by hand);
- ``oracle_content``: the oracle log (an upper bound: the true content crossed with the segment).

LR sees dense inputs linearly (one weight per feature), so without the cross it can only learn which images
are liked on average; the segment x image interaction needs the cross or a model that mixes dense and
categorical inputs (DeepFM's MLP). The oracle hands the models the cross ready-made.

The CNN is a `mariana vision train` run (``--cnn RUN``; default runs/demo/vision when it exists); without
one, ``mariana vision train --preset small --limit 8000`` trains it on ``--cnn-train`` (~2 min on 2 cores).

Usage: ``.venv/bin/python bench/pctr_cnn_lr.py`` -> bench/results/pctr_cnn_lr-cpu.json and a table.
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
from common import table, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPLIT = "0.7,0.1,0.2"


def mariana(args: list, log: Path) -> float:
    """Run ``mariana ARGS`` (stdout+stderr to ``log``); returns its wall time in seconds."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "mariana.platform.cli", *map(str, args)]
    print("$ mariana", " ".join(map(str, args)), file=sys.stderr, flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(
            f"mariana {' '.join(map(str, args))} failed ({rc}); see {log}:\n{log.read_text()[-3000:]}"
        )
    return time.perf_counter() - t0


def build(args, work: Path) -> dict:
    """Write WORK/images/*.jpg, WORK/clicks.tsv and WORK/clicks-oracle.tsv; returns facts about them."""
    from mariana.apps.vision.data import open_source

    rng = np.random.default_rng(args.seed)
    src = open_source(args.data)
    pick = np.sort(rng.choice(len(src), size=min(args.ads, len(src)), replace=False))
    images = work / "images"
    images.mkdir(parents=True, exist_ok=True)
    for j, i in enumerate(pick):
        blob = src.read(int(i))
        ext = ".jpg" if blob[:3] == b"\xff\xd8\xff" else ".png"
        out = images / f"ad{j}{ext}"
        if not (out.is_file() and out.read_bytes() == blob):  # unchanged files keep the feature cache valid
            out.write_bytes(blob)
    content = src.labels[pick].numpy()
    n_ads = len(pick)
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
    empty_ints = "\t" * 13
    with open(work / "clicks.tsv", "w") as f, open(work / "clicks-oracle.tsv", "w") as g:
        for k in range(args.impressions):
            head = f"{y[k]}{empty_ints}\tu{u[k]}\ts{s[k]}\tad{a[k]}\tadv{adv_of_ad[a[k]]}\tp{pos[k]}"
            f.write(head + "\t" * 21 + "\n")
            g.write(f"{head}\ts{s[k]}c{content[a[k]]}" + "\t" * 20 + "\n")
    return {"ads": n_ads, "ctr": float(y.mean()), "rows": int(args.impressions)}


def collect(run: Path, train_s: float) -> dict:
    """Test metrics (`mariana pctr eval --split test`) and training facts of one finished run."""
    ev = json.loads(next((run / "eval").glob("*-test.json")).read_text())
    final = json.loads((run / "metrics.json").read_text())
    return {
        "test_auc": ev["auc"],
        "test_logloss": ev["logloss"],
        "test_rows": ev["rows"],
        "val_auc": final.get("val_auc"),
        "steps": final.get("steps"),
        "train_s": round(train_s, 1),
        **({"image_features": final["image_features"]} if "image_features" in final else {}),
    }


def main(argv=None) -> int:
    data = ROOT.parent / "shared" / "data" / "cifar10"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--data", default=str(data / "test-dev.tar"), help="creatives: CIFAR-10 tar (ImageFolder)"
    )
    demo = ROOT / "runs" / "demo" / "vision"
    default_cnn = str(demo) if (demo / "model.safetensors").is_file() else ""
    ap.add_argument(
        "--cnn", default=default_cnn, help="run directory of `mariana vision train` (default: train one)"
    )
    ap.add_argument(
        "--cnn-train", default=str(data / "train.tar"), help="images to train the CNN on if needed"
    )
    ap.add_argument("--work", default="runs/pctr-cnn-lr", help="where the click logs, images and runs go")
    ap.add_argument("--ads", type=int, default=2000, help="creatives (images)")
    ap.add_argument("--users", type=int, default=1000, help="users")
    ap.add_argument("--segments", type=int, default=20, help="observable user segments")
    ap.add_argument("--advertisers", type=int, default=50, help="advertisers")
    ap.add_argument(
        "--impressions", type=int, default=100_000, help="impressions (70/10/20 %% train/val/test)"
    )
    ap.add_argument("--image-dims", type=int, default=16, help="CNN feature dimensions kept (PCA)")
    ap.add_argument("--models", default="lr,deepfm", help="pctr models to compare, comma-separated")
    ap.add_argument("--seed", type=int, default=0, help="seed of the generator")
    ap.add_argument(
        "--reuse", action="store_true", help="keep runs an earlier invocation finished (same data and flags)"
    )
    args = ap.parse_args(argv)
    work = (ROOT / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)

    cnn = args.cnn
    if not cnn:
        cnn = str(work / "cnn")
        if not (Path(cnn) / "model.safetensors").is_file():
            cmd = [
                "vision",
                "train",
                "--data",
                args.cnn_train,
                "--out",
                cnn,
                "--preset",
                "small",
                "--limit",
                "8000",
            ]
            mariana([*cmd, "--no-progress"], logs / "cnn.log")
    cnn_meta = json.loads((Path(cnn) / "model.json").read_text())
    facts = build(args, work)
    cache = work / "feature-cache"
    common = ["--format", "criteo", "--split", SPLIT, "--rows-per-field", 4096, "--seed", args.seed]
    image = ["--image-features", cnn, "--image-field", "C3", "--images", work / "images"]
    image += ["--image-dims", args.image_dims, "--image-cache", cache]
    variants = {
        "without_images": (work / "clicks.tsv", []),
        "with_images": (work / "clicks.tsv", image),
        "with_images_x_segment": (work / "clicks.tsv", [*image, "--image-cross", "C2"]),
        "oracle_content": (work / "clicks-oracle.tsv", []),
    }
    results: dict = {}
    for model in args.models.split(","):
        for name, (log_file, extra) in variants.items():
            run = work / f"{model}-{name}"
            done = run / "bench-train-s.txt"
            if args.reuse and done.is_file() and list((run / "eval").glob("*-test.json")):
                train_s = float(done.read_text())  # finished by an earlier invocation on the same data
                print(f"reusing {run}", file=sys.stderr)
                results.setdefault(model, {})[name] = collect(run, train_s)
                continue
            if run.exists():
                import shutil

                shutil.rmtree(run)
            train_s = mariana(
                ["pctr", "train", *common, "--data", log_file, "--model", model, "--out", run, *extra],
                logs / f"{model}-{name}-train.log",
            )
            done.write_text(f"{train_s:.1f}\n")
            mariana(
                [
                    "pctr",
                    "eval",
                    "--model",
                    run,
                    "--data",
                    log_file,
                    "--split",
                    "test",
                ],
                logs / f"{model}-{name}-eval.log",
            )
            results.setdefault(model, {})[name] = collect(run, train_s)
            print(f"{model:8s} {name:22s} test AUC {results[model][name]['test_auc']:.4f}", file=sys.stderr)
    payload = {
        "benchmark": "pctr_cnn_lr",
        "setup": {**vars(args), "cnn": cnn, "split": SPLIT},
        "cnn": {
            "run": cnn,
            "arch": cnn_meta.get("arch"),
            "version": cnn_meta.get("version"),
            "metrics": cnn_meta.get("metrics"),
        },
        "data": facts,
        "results": results,
    }
    path = write_result("pctr_cnn_lr", payload)
    rows = [{"model": m, **{k: f"{v['test_auc']:.4f}" for k, v in r.items()}} for m, r in results.items()]
    print(table(rows, ["model", *variants]))
    print(f"test AUC on {facts['rows']} impressions x 20 %, CTR {facts['ctr']:.3f}; results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
