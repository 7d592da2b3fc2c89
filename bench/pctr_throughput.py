"""Training throughput (samples/s) of DeepFM on Criteo-shaped data, CPU.

1. A generator writes ``--rows`` lines in the Criteo TSV format: 13 integer counts (geometric) and 26
   categorical fields whose ids are drawn from a power law (Zipf, exponent ``--zipf``) over
   ``--rows-per-field`` values each, written as 8-hex-digit hashes; labels from a logistic model.
2. ``ours``: `mariana pctr train --servers 0` (DeepFM, dim 16, batch 2048; the same code as the CLI);
   samples/s of the whole run (epoch 1 parses the text in a background thread, epoch 2 reads the cache).
3. ``plain``: a plain PyTorch loop on the same shapes, already-parsed tensors: one
   ``nn.EmbeddingBag(sparse=True)`` over all fields' rows + FM + MLP, ``SparseAdam`` + ``Adam``, batch 2048.
4. ``ps``: `mariana pctr train --servers 1 --workers W` for W = 1 and 2 (sum of the workers' samples/s).

Usage: ``.venv/bin/python bench/pctr_throughput.py [--rows 200000 --rows-per-field 100000]``
-> bench/results/pctr_throughput-cpu.json; the issue's full shape is ``--rows-per-field 1000000``
(26 tables of 1M x 16 need ~5 GB for the plain loop with Adam state).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def generate(path: Path, rows: int, R: int, zipf: float, seed: int = 0) -> None:
    """Write a Criteo-format TSV (streamed in blocks; memory O(block))."""
    rng = np.random.default_rng(seed)
    w_field = rng.normal(0, 0.3, 26)
    with open(path, "w") as f:
        for start in range(0, rows, 50_000):
            n = min(50_000, rows - start)
            ints = rng.geometric(0.1, (n, 13)) - 1
            cats = (rng.zipf(zipf, (n, 26)) - 1) % R
            logit = -1.2 + ((cats % 7 == 0) * w_field).sum(1) + 0.05 * np.log1p(ints[:, 0])
            y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
            hexes = np.char.mod("%08x", (cats * 2654435761 + np.arange(26)) % (1 << 32))
            lines = [
                "\t".join([str(y[i]), *map(str, ints[i]), *hexes[i]]) for i in range(n)
            ]  # generator only: not a measured path
            f.write("\n".join(lines) + "\n")


def plain_loop(path: Path, R: int, dim: int, batch: int, steps: int) -> dict:
    from mariana.apps.pctr.data import Encoder, infer_schema, load_split

    enc = Encoder(infer_schema(path, "criteo", R))
    data = load_split(path, enc, 0, None)
    cats = (data.ids[:, 13:] - torch.arange(13, 39) * R).contiguous()  # per-field local ids [N, 26]
    y = data.labels

    class Plain(nn.Module):
        """One EmbeddingBag over the 26 fields' rows (per-field offsets), column 0 = linear weight."""

        def __init__(self):
            super().__init__()
            self.emb = nn.EmbeddingBag(26 * R, 1 + dim, mode="sum", sparse=True)
            self.register_buffer("base", torch.arange(26) * R)
            self.mlp = nn.Sequential(nn.Linear(26 * dim, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU())
            self.head = nn.Linear(128, 1)

        def forward(self, x):
            rows = self.emb((x + self.base).reshape(-1, 1)).view(x.shape[0], 26, 1 + dim)
            lin, e = rows[..., 0].sum(1), rows[..., 1:]
            s = e.sum(1)
            fm = 0.5 * (s * s - (e * e).sum(1)).sum(1)
            return lin + fm + self.head(self.mlp(e.flatten(1))).squeeze(1)

    m = Plain()
    sparse_p = [m.emb.weight]
    dense_p = [p for n, p in m.named_parameters() if not n.startswith("emb")]
    opts = [torch.optim.SparseAdam(sparse_p, lr=1e-3), torch.optim.Adam(dense_p, lr=1e-3)]
    n = len(y)
    t0, done = None, 0
    for k in range(steps + 3):
        if k == 3:  # warm-up steps excluded
            t0, done = time.perf_counter(), 0
        a = (k * batch) % max(1, n - batch)
        xb, yb = cats[a : a + batch], y[a : a + batch]
        for o in opts:
            o.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(m(xb), yb).backward()
        for o in opts:
            o.step()
        done += len(yb)
    return {"samples_per_s": done / (time.perf_counter() - t0), "steps": steps, "batch": batch}


def cli_train(path: Path, out: Path, R: int, batch: int, epochs: int, extra: list[str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "mariana.platform.cli", "pctr", "train", "--data", str(path)]
    cmd += ["--format", "criteo", "--out", str(out), "--model", "deepfm", "--rows-per-field", str(R)]
    cmd += ["--batch-size", str(batch), "--epochs", str(epochs), "--no-progress", *extra]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
    return json.loads((out / "metrics.json").read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="runs/bench-criteo/criteo_synth.tsv", help="generated file")
    ap.add_argument("--rows", type=int, default=200_000, help="generated lines")
    ap.add_argument("--rows-per-field", type=int, default=100_000, help="hash space per field")
    ap.add_argument("--zipf", type=float, default=1.2, help="power-law exponent of the ids")
    ap.add_argument("--batch", type=int, default=2048, help="batch size")
    ap.add_argument("--plain-steps", type=int, default=30, help="timed steps of the plain loop")
    ap.add_argument("--ps", default="1,2", help="worker counts of the parameter-server runs ('' skips)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    path = Path(args.data)
    path.parent.mkdir(parents=True, exist_ok=True)
    R = args.rows_per_field
    if not path.is_file():
        generate(path, args.rows, R, args.zipf)
    res: dict = {}
    m = cli_train(path, path.parent / "ours", R, args.batch, 2, [])
    res["ours"] = {"samples_per_s": m["samples_per_s"], "val_auc": m["val_auc"], "wall_s": m["wall_s"]}
    print(f"ours (one process)   {m['samples_per_s']:10.0f} samples/s", flush=True)
    res["plain"] = plain_loop(path, R, 16, args.batch, args.plain_steps)
    print(f"plain PyTorch loop   {res['plain']['samples_per_s']:10.0f} samples/s", flush=True)
    for w in filter(None, args.ps.split(",")):
        out = path.parent / f"ps-w{w}"
        cli_train(path, out, R, args.batch, 1, ["--servers", "1", "--workers", w])
        c = json.loads((out / "counters.json").read_text())
        rate = sum(v["last"]["samples_per_s"] for v in c["workers"].values())
        res[f"ps_s1_w{w}"] = {"samples_per_s": rate, "wall_s": c["wall_s"]}
        print(f"PS 1 server {w} worker(s) {rate:10.0f} samples/s", flush=True)
    res["ours_vs_plain"] = res["ours"]["samples_per_s"] / res["plain"]["samples_per_s"]
    path_out = write_result(
        "pctr_throughput", {"benchmark": "pctr_throughput", "setup": vars(args), "results": res}
    )
    print(f"results in {path_out}")
    print(f"ours/plain {res['ours_vs_plain']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
