"""`bench/pctr_throughput.py --device cuda`: our one-process step against the like-for-like plain loop on
one device, in-process, interleaved rounds.

Both train DeepFM on the same generated batches, already on the device: 26 fields of ``R`` rows (power-law
ids), 13 dense features, rows of 1 + ``dim`` floats (linear weight + embedding), MLP 429-512-256-1 at the
issue's sizes, Adagrad rows (lr 0.05) and Adam dense layers (lr 1e-3), fp32:

- ``ours``: the `LocalStep` `pctr train --device DEVICE` runs by default (``--compile auto``): on CUDA
  `SparseStep` compiled by inductor and replayed as a CUDA graph, on the CPU eager;
- ``ours_eager``: the same with ``--compile off`` (fixed shapes, no host reads, ``trim`` off on CUDA);
- ``ours_compiled_nograph`` (``--compile``, CUDA): compiled by inductor without CUDA graphs;
- ``plain``: ``nn.EmbeddingBag(sum, sparse=True)`` over all rows + the same FM and MLP,
  ``torch.optim.Adagrad`` on its sparse gradient + ``Adam`` (fused on CUDA): the plain PyTorch loop at its
  fastest (sparse gradients cannot be compiled or captured).

``cuda_graph`` (CUDA): whether ``ours`` replays a CUDA graph (`graph_check`). Each loop runs ``--steps``
timed steps per round (after warm-up, which compiles and records); the result is the median over rounds of
the per-round ratio ours / plain.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from common import PlainDeepFM
from mariana.apps.pctr.data.encoding import Batch
from torch import nn
from torch._dynamo.utils import counters

F_, D_ = 26, 13


def make_data(R: int, B: int, n: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cats = ((torch.rand(n * B, F_, generator=g) ** 6) * R).long()
    dense = torch.randn(n * B, D_, generator=g)
    y = (torch.rand(n * B, generator=g) < 0.25).float()
    return cats.to(device), dense.to(device), y.to(device)


def ours_step(R: int, dim: int, hidden, device, compile: str = "auto"):
    """step(cats, dense, y) of the `LocalStep` `pctr train --servers 0` builds on ``device`` with
    ``--compile compile`` (auto: compiled with CUDA graphs on CUDA, eager on the CPU; "nograph": compiled by
    inductor without CUDA graphs), fp32 (``--amp off``, as the plain loop), no regulariser the plain loop
    lacks (``--l2-emb 0``); ``step.local`` is the `LocalStep`."""
    from mariana.apps.pctr.configs import PctrConfig
    from mariana.apps.pctr.models.nets import CTRModel
    from mariana.apps.pctr.models.optim import build_dense, row_config
    from mariana.platform.sparse.local import LocalStep

    cfg = PctrConfig(
        model="deepfm", dim=dim, hidden=",".join(map(str, hidden)), rows_per_field=R, sparse_lr=0.05, lr=1e-3,
        l2_emb=0.0, amp="off", compile="off" if compile == "nograph" else compile, device=str(device),
    )  # fmt: skip
    torch.manual_seed(0)
    model = CTRModel("deepfm", F_ * R, F_, D_, dim, hidden).to(device)
    dense_opt = build_dense(cfg.optim, model.dense_parameters())
    local = LocalStep(
        cfg, model, model.table.weight.data, row_config(cfg.table), dense_opt, device, unit_vals=True
    )
    local.setup(1 << 30)
    if compile == "nograph":
        local.compiled = ("inductor", None)
        local.fixed.compile(*local.compiled)
    base = torch.arange(F_, device=device) * R
    ones = torch.ones(1, F_, device=device)

    def step(cats, dense, y):
        local.train_step([Batch(cats + base, ones.expand(len(y), F_), dense, y)])

    step.local = local
    return step


def plain_step(R: int, dim: int, hidden, device):
    torch.manual_seed(0)
    m = PlainDeepFM(F_, R, dim, hidden, D_).to(device)
    dense = [p for n, p in m.named_parameters() if not n.startswith("emb")]
    opts = [  # Adam at its fastest on a GPU (fused, one kernel), as our dense optimiser
        torch.optim.Adagrad([m.emb.weight], lr=0.05),
        torch.optim.Adam(dense, lr=1e-3, fused=device.type == "cuda"),
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
    """The rounds on ``args.device``: {loop: {samples_per_s (median), rounds}, <loop>_vs_plain(_rounds),
    cuda_graph}. ``ours``: the step `pctr train` runs by default on the device; ``ours_eager``: with
    ``--compile off``; ``ours_compiled_nograph`` (``--compile``): inductor without CUDA graphs."""
    device = torch.device(args.device)
    R, B, dim = args.rows_per_field, args.batch, args.dim
    hidden = tuple(int(h) for h in args.hidden.split(","))
    data = make_data(R, B, 8, device)
    counters.clear()
    loops = {
        "ours": ours_step(R, dim, hidden, device),
        "ours_eager": ours_step(R, dim, hidden, device, "off"),
        "plain": plain_step(R, dim, hidden, device),
    }
    if args.compile and device.type == "cuda":
        loops["ours_compiled_nograph"] = ours_step(R, dim, hidden, device, "nograph")
    t0 = time.perf_counter()
    for s in loops.values():
        timed(s, data, B, 3, device)  # warm-up (and compilation, CUDA-graph recording)
    print(f"warm-up (compilation included) {time.perf_counter() - t0:.0f} s", flush=True)
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
    res["ours_mode"] = loops["ours"].local.compiled  # (backend, mode) or None: eager
    res["cuda_graph"] = graph_check(loops["ours"], data, B) if device.type == "cuda" else None
    print(f"ours runs {res['ours_mode']}; CUDA graphs: {res['cuda_graph']}")
    return res


def graph_check(ours, data, B: int) -> dict:
    """Whether ``ours`` replays CUDA graphs: no ``cudagraph_skips`` (inductor counts a graph it runs
    without capture there; ``cudagraph_recorded_non_static_inputs`` counts the inputs copied into a
    recorded graph, the batch: not a skip), one compiled graph, and a replay overwrites the previous
    step's outputs (reading a dense gradient of the step before raises)."""
    ind = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
    cats, dense, y = data
    p = ours.local.model.dense_parameters()[0]
    ours(cats[:B], dense[:B], y[:B])
    old = p.grad
    ours(cats[B : 2 * B], dense[B : 2 * B], y[B : 2 * B])
    try:
        float(old.sum())
        overwritten = False
    except (
        RuntimeError
    ) as e:  # cudagraph trees: "accessing tensor output of CUDAGraphs that has been overwritten"
        overwritten = "overwritten" in str(e)
    return {
        "captured": ind.get("cudagraph_skips", 0) == 0
        and ind.get("cudagraph_recorded_non_static_inputs", 0) > 0,
        "replay_overwrites_outputs": overwritten,
        "unique_graphs": counters["stats"]["unique_graphs"],
        "cudagraph_counters": ind,
    }
