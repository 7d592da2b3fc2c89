"""FBGEMM's table-batched embedding (TBE, what TorchRec uses) against our fixed-shape step, CPU.

Both train the same DeepFM (26 fields, ``--rows-per-field`` rows each, dim 16 + a linear weight per row,
MLP 416-256-128-1, Adam on the dense layers) on the same power-law ids, batch ``--batch``, fp32:

- ``ours``: `mariana.platform.sparse.step.SparseStep` (one gather, autograd, per-coordinate row
  Adagrad on the batch's distinct rows) -- the step `pctr train` runs;
- ``fbgemm``: ``SplitTableBatchedEmbeddingBagsCodegen`` (one lookup for all 26 tables, backward with the
  optimiser fused, ``EXACT_ROWWISE_ADAGRAD``: one accumulator per row, FBGEMM's only Adagrad) on CPU; its rows are 20 floats wide (a multiple of 4 is required), 3 unused.

Interleaved ``--rounds`` rounds of ``--steps`` steps; reported per round and as the median of the
per-round ratios fbgemm / ours. Needs ``pip install fbgemm-gpu-cpu`` (1.4.0 for torch 2.9).
Usage: ``.venv/bin/python bench/pctr_fbgemm.py`` -> bench/results/pctr_fbgemm-cpu.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

F_, DIM = 26, 16
WIDE = 20  # FBGEMM's rows are a multiple of 4 floats: 1 + 16 padded to 20 (its columns 17.. unused)


def batches(R: int, B: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cats = ((torch.rand(n * B, F_, generator=g) ** 6) * R).long()  # power law: few hot rows
    return cats, (torch.rand(n * B, generator=g) < 0.3).float()


class Head(nn.Module):
    """DeepFM on looked-up rows: linear weights w [B, F], embeddings e [B, F, 16] -> logits [B]."""

    def __init__(self):
        super().__init__()
        self.deep = nn.Sequential(nn.Linear(F_ * DIM, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU())
        self.out, self.bias = nn.Linear(128, 1), nn.Parameter(torch.zeros(1))

    def forward_parts(self, w, e, vals, dense):
        s = e.sum(1)
        fm = 0.5 * (s * s - (e * e).sum(1)).sum(1)
        return w.sum(1) + self.bias + fm + self.out(self.deep(e.flatten(1))).squeeze(1)


def ours(R: int):
    from mariana.platform.sparse.rules import RowOptConfig, init_state
    from mariana.platform.sparse.step import SparseStep

    torch.manual_seed(0)
    head = Head()
    weight = torch.randn(F_ * R, 1 + DIM) * 0.01
    opt = RowOptConfig("adagrad", 0.05)
    fx = SparseStep(head, weight, init_state("adagrad", weight, opt), torch.zeros(F_ * R, dtype=torch.bool))
    fx.unit_vals = True
    dense_opt = torch.optim.Adam(head.parameters(), 1e-3)
    base = torch.arange(F_) * R
    ones, none = torch.ones(1, F_), torch.zeros(1, 0)

    def step(cats, y):
        ids = cats + base
        loss, grads = fx(ids, ones.expand(len(y), F_), none.expand(len(y), 0), y, opt)
        for p, g in zip(head.parameters(), grads):
            p.grad = g
        dense_opt.step()

    return step


def fbgemm(R: int, B: int):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    torch.manual_seed(0)
    head = Head()
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(R, WIDE, EmbeddingLocation.HOST, ComputeDevice.CPU)] * F_,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.05,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
    )
    dense_opt = torch.optim.Adam(head.parameters(), 1e-3)
    offsets = torch.arange(F_ * B + 1, dtype=torch.int64)  # one id per (table, sample) bag

    def step(cats, y):
        # TBE's layout: table-major indices [F * B], bag offsets [F * B + 1]
        pooled = tbe(cats.t().contiguous().reshape(-1), offsets).view(len(y), F_, WIDE)
        logits = head.forward_parts(pooled[..., 0], pooled[..., 1 : 1 + DIM], None, None)
        dense_opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(logits, y).backward()  # rows updated in here
        dense_opt.step()

    return step


def timed(step, cats, y, B: int, steps: int) -> float:
    n = len(y) // B
    t0 = time.perf_counter()
    for k in range(steps):
        a = (k % n) * B
        step(cats[a : a + B], y[a : a + B])
    return steps * B / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows-per-field", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    R, B = args.rows_per_field, args.batch
    cats, y = batches(R, B, 10)
    loops = {"ours": ours(R), "fbgemm": fbgemm(R, B)}
    for s in loops.values():
        timed(s, cats, y, B, 3)  # warm-up
    rounds: dict[str, list[float]] = {k: [] for k in loops}
    for r in range(args.rounds):
        for k, s in loops.items():
            rounds[k].append(timed(s, cats, y, B, args.steps))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in rounds.items()), flush=True)
    ratios = [f / o for f, o in zip(rounds["fbgemm"], rounds["ours"])]
    res = {
        "samples_per_s": {k: float(np.median(v)) for k, v in rounds.items()},
        "rounds": rounds,
        "fbgemm_vs_ours_rounds": ratios,
        "fbgemm_vs_ours": float(np.median(ratios)),
    }
    print(f"fbgemm / ours: median {res['fbgemm_vs_ours']:.2f}x of rounds {[round(x, 2) for x in ratios]}")
    import fbgemm_gpu

    out = write_result(
        "pctr_fbgemm",
        {
            "benchmark": "pctr_fbgemm",
            "setup": vars(args),
            "fbgemm_gpu": fbgemm_gpu.__version__,
            "results": res,
        },
    )
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
