"""`bench/pctr_throughput.py --device cuda`: our one-process step against the like-for-like plain loop on
one device, in-process, interleaved rounds.

Both train DeepFM on the same generated batches, already on the device: 26 fields of ``R`` rows (power-law
ids), 13 dense features, rows of 1 + ``dim`` floats (linear weight + embedding), MLP 429-512-256-1 at the
issue's sizes, Adagrad rows (lr 0.05) and Adam dense layers (lr 1e-3), fp32:

- ``ours``: `FixedShapeStep` as `pctr train` runs it on a GPU (fixed shapes, no host reads, ``trim`` off);
- ``ours_compiled`` (``--compile``): the same step through ``torch.compile(fullgraph=True)``;
- ``plain``: ``nn.EmbeddingBag(sum, sparse=True)`` over all rows + the same FM and MLP,
  ``torch.optim.Adagrad`` on its sparse gradient + ``Adam``: the plain PyTorch loop.

``cuda_graph``: whether the compiled step captures into a CUDA graph (``mode="reduce-overhead"``), with
its rate, or the error. Each loop runs ``--steps`` timed steps per round (after warm-up); the result is
the median over rounds of the per-round ratio ours / plain.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

F_, D_ = 26, 13


def make_data(R: int, B: int, n: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cats = ((torch.rand(n * B, F_, generator=g) ** 6) * R).long()
    dense = torch.randn(n * B, D_, generator=g)
    y = (torch.rand(n * B, generator=g) < 0.25).float()
    return cats.to(device), dense.to(device), y.to(device)


def ours_step(R: int, dim: int, hidden, device, compile_mode: str | None = None):
    """(step(cats, dense, y), model) of our fixed-shape step on ``device``."""
    from mariana.apps.pctr.model import CTRModel
    from mariana.platform.ps.rowopt import RowOptConfig, init_state
    from mariana.platform.ps.sparse_step import FixedShapeStep

    torch.manual_seed(0)
    model = CTRModel("deepfm", F_ * R, F_, D_, dim, hidden).to(device)
    w = model.table.weight.data
    opt = RowOptConfig("adagrad", 0.05)
    seen = torch.zeros(F_ * R, dtype=torch.bool, device=device)
    fx = FixedShapeStep(model, w, init_state("adagrad", w, opt), seen, unit_vals=True, trim=False)
    dense_opt = torch.optim.Adam(model.dense_parameters(), 1e-3)
    base = torch.arange(F_, device=device) * R
    names = fx.names
    fn = fx.step
    if compile_mode is not None:
        if compile_mode == "reduce-overhead":  # tensors the graph updates in place: fixed addresses
            for t in (w, seen, *fx.state.values()):
                torch._dynamo.mark_static_address(t)
        fn = torch.compile(fx.step, fullgraph=True, mode=compile_mode)
    ones = torch.ones(1, F_, device=device)

    def step(cats, dense, y):
        ids = cats + base
        if fx.used is None:
            fx.used = fx.used_parameters(ids[:1], ones, dense[:1])
        params = {f"m.{n}": p.detach() for n, p in model.named_parameters() if n in names}
        _, grads = fn(params, ids, ones.expand(len(y), F_), dense, y, opt)
        for p, g in zip(model.dense_parameters(), grads):
            p.grad = g
        dense_opt.step()

    return step


def plain_step(R: int, dim: int, hidden, device):
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.EmbeddingBag(F_ * R, 1 + dim, mode="sum", sparse=True)
            self.register_buffer("base", torch.arange(F_) * R)
            sizes = [F_ * dim + D_, *hidden]
            layers: list[nn.Module] = []
            for a, b in zip(sizes[:-1], sizes[1:]):
                layers += [nn.Linear(a, b), nn.ReLU()]
            self.mlp, self.head = nn.Sequential(*layers), nn.Linear(sizes[-1], 1)
            self.dense_linear = nn.Linear(D_, 1)

        def forward(self, x, dense):
            rows = self.emb((x + self.base).reshape(-1, 1)).view(x.shape[0], F_, 1 + dim)
            lin, e = rows[..., 0].sum(1), rows[..., 1:]
            s = e.sum(1)
            fm = 0.5 * (s * s - (e * e).sum(1)).sum(1)
            deep = self.head(self.mlp(torch.cat([e.flatten(1), dense], 1))).squeeze(1)
            return lin + self.dense_linear(dense).squeeze(1) + fm + deep

    torch.manual_seed(0)
    m = Plain().to(device)
    opts = [
        torch.optim.Adagrad([m.emb.weight], lr=0.05),
        torch.optim.Adam([p for n, p in m.named_parameters() if not n.startswith("emb")], lr=1e-3),
    ]

    def step(cats, dense, y):
        for o in opts:
            o.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(m(cats, dense), y).backward()
        for o in opts:
            o.step()

    return step


def timed(step, data, B: int, steps: int, device) -> float:
    cats, dense, y = data
    n = len(y) // B
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for k in range(steps):
        a = (k % n) * B
        step(cats[a : a + B], dense[a : a + B], y[a : a + B])
    sync()
    return steps * B / (time.perf_counter() - t0)


def device_rounds(args) -> dict:
    """The rounds on ``args.device``: {loop: {samples_per_s (median), rounds}, ours_vs_plain(_rounds),
    cuda_graph}."""
    device = torch.device(args.device)
    R, B, dim = args.rows_per_field, args.batch, args.dim
    hidden = tuple(int(h) for h in args.hidden.split(","))
    data = make_data(R, B, 8, device)
    loops = {"ours": ours_step(R, dim, hidden, device), "plain": plain_step(R, dim, hidden, device)}
    if args.compile:
        loops["ours_compiled"] = ours_step(R, dim, hidden, device, "default")
    for s in loops.values():
        timed(s, data, B, 3, device)  # warm-up (and compilation)
    rounds: dict[str, list[float]] = {k: [] for k in loops}
    for r in range(args.rounds):
        for k, s in loops.items():
            rounds[k].append(timed(s, data, B, args.steps, device))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in rounds.items()), flush=True)
    res: dict = {k: {"samples_per_s": float(np.median(v)), "rounds": v} for k, v in rounds.items()}
    for k in [k for k in loops if k != "plain"]:
        ratios = [a / b for a, b in zip(rounds[k], rounds["plain"])]
        res[f"{k}_vs_plain_rounds"], res[f"{k}_vs_plain"] = ratios, float(np.median(ratios))
        print(f"{k} / plain: median {np.median(ratios):.2f}x of rounds {[round(x, 2) for x in ratios]}")
    graphs = device.type == "cuda" and args.compile
    res["cuda_graph"] = cuda_graph_check(R, dim, hidden, data, B, device) if graphs else None
    return res


def cuda_graph_check(R, dim, hidden, data, B, device) -> dict:
    """Whether the compiled step runs under CUDA graphs (``reduce-overhead``), and its rate."""
    try:
        from torch._dynamo.utils import counters

        step = ours_step(R, dim, hidden, device, "reduce-overhead")
        timed(step, data, B, 3, device)
        rate = timed(step, data, B, 20, device)
        skipped = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k and v}
        return {"captured": not skipped, "samples_per_s": rate, "cudagraph_counters": skipped}
    except Exception as e:  # report, not fail: this is a check of the step, the rates stand without it
        return {"captured": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
