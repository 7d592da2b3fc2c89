"""The CPU target of issue 32 in one process: our one-process pCTR step against the dense-layers floor,
step blocks interleaved, fp32 and bf16.

``bench/pctr_throughput.py --target`` compares the CLI's steady rate (its log records over ~30 steps of
a cached epoch, a subprocess per run) with a floor timed minutes later in another process: on this shared
2-core machine single rates swing 4-10x between rounds, so the per-round ratio swings with them. Here
both sides run in the same process on the same batches, alternating blocks of ``--block`` steps, so a
load change hits both sides of a round alike.

- ``ours``: the step ``pctr train`` runs on a CPU (`apps/pctr/models/step.py:make_local_step`: `LocalStep` ->
  `SparseStep` with the trimmed unique-row path, its table work in `sparse.kernels`' C loops, Adagrad rows at 0.05, fused Adam on the dense layers
  at 1e-3, ``--amp off|bf16``), DeepFM on Criteo's layout: 13 bucketed-count + 26 categorical fields of
  ``R`` rows each, rows of 1 + 16 floats, 13 dense features, MLP 637-256-128-1 (the CLI's defaults);
- ``ours_compiled``: the same with ``--compile on`` (inductor: the fixed-shape step as one compiled C++
  graph; the CLI's ``auto`` compiles on CUDA only, since the CPU compile costs 20-45 s a process);
- ``floor``: the same shapes as a plain PyTorch model (``nn.EmbeddingBag`` lookup, FM, MLP, dense
  linear) with the table's own work removed (rows looked up, their gradient computed and dropped,
  nothing scattered or updated), fused Adam on the dense layers: what any step of this model costs;
- ``plain``: the floor's model with the table trained (``sparse=True`` gradient + ``torch.optim.Adagrad``
  at 0.05): the like-for-like plain loop, for reference.

Ids follow a Zipf(``--zipf``) law per field (the CLI bench's generator). Run through
``bench/pctr_throughput.py --target`` (one table: median samples/s, the median of the per-round ratios
ours / floor and ours / plain per precision; then a per-operator breakdown of a bf16 step of ours and of
the floor; ``bench/results/pctr_throughput-cpu.json``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PlainDeepFM  # noqa: E402
from mariana.apps.pctr.configs import PctrConfig  # noqa: E402
from mariana.apps.pctr.data.encoding import Batch, Schema  # noqa: E402
from mariana.apps.pctr.models.step import make_local_step  # noqa: E402
from mariana.platform.ps.shard import TableSpec  # noqa: E402

FIELDS, DENSE, DIM, HIDDEN = 39, 13, 16, (256, 128)
PRECISION = {"off": "fp32", "bf16": "bf16"}  # --amp value -> the results' name


def make_batches(R: int, B: int, n: int, zipf: float, seed: int = 0) -> list[Batch]:
    """``n`` batches of ``B`` rows: ids [B, 39] (field f's ids in [f R, (f + 1) R)), values 1, 13 dense
    features ~ N(0, 1), labels ~ Bernoulli(0.25)."""
    rng = np.random.default_rng(seed)
    base = np.arange(FIELDS) * R
    out = []
    for _ in range(n):
        ids = (rng.zipf(zipf, size=(B, FIELDS)) - 1) % R + base
        out.append(
            Batch(
                ids=torch.from_numpy(ids.astype(np.int64)),
                vals=torch.ones(B, FIELDS),
                dense=torch.from_numpy(rng.standard_normal((B, DENSE), dtype=np.float32)),
                labels=torch.from_numpy((rng.random(B) < 0.25).astype(np.float32)),
            )
        )
    return out


def ours_loop(R: int, amp: str, compile: str = "auto"):
    """One training step of ``pctr train --device cpu --amp AMP --compile COMPILE`` (the CLI's own
    builder; ``auto`` is eager on the CPU, ``on`` compiles the fixed-shape step with inductor)."""
    hidden = ",".join(map(str, HIDDEN))
    cfg = PctrConfig(model="deepfm", dim=DIM, hidden=hidden, amp=amp, l2_emb=0.0, compile=compile)
    schema = Schema("criteo", FIELDS, R, DENSE)
    spec = TableSpec("table", schema.num_rows, 1 + DIM, cfg.init_std)
    torch.manual_seed(0)
    step = make_local_step(cfg, SimpleNamespace(schema=schema, spec=spec, image=None), torch.device("cpu"))
    step.setup(10**9)
    return lambda b: step.train_step([b])


def plain_loop(R: int, amp: str, floor: bool):
    torch.manual_seed(0)
    m = PlainDeepFM(FIELDS, R, DIM, HIDDEN, DENSE, offsets=False, floor=floor)
    opts = [
        torch.optim.Adam([p for n, p in m.named_parameters() if not n.startswith("emb")], 1e-3, fused=True)
    ]
    if not floor:
        opts.append(torch.optim.Adagrad([m.emb.weight], lr=0.05))

    def step(b: Batch):
        for o in opts:
            o.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16"):
            logits = m(b.ids, b.dense)
        loss = nn.functional.binary_cross_entropy_with_logits(logits.float(), b.labels)
        loss.backward()
        for o in opts:
            o.step()
        return loss

    return step


def timed(step, batches, start: int, steps: int) -> float:
    t0 = time.perf_counter()
    for k in range(steps):
        step(batches[(start + k) % len(batches)])
    return steps * len(batches[0].labels) / (time.perf_counter() - t0)


def target_rounds(R: int, B: int, zipf: float, rounds: int, block: int, amps: list[str]) -> dict:
    """The loops of each precision in ``amps`` ("off", "bf16") interleaved over ``rounds`` rounds of
    ``block`` steps each: {loop: {samples_per_s (median), rounds}, fp32|bf16_ours_vs_{floor,plain}(_rounds):
    the median of the per-round ratios (and the ratios)}. Prints a line per round and the table."""
    batches = make_batches(R, B, 16, zipf)
    loops = {}
    for amp in amps:
        p = PRECISION[amp]
        loops[f"ours_{p}"] = ours_loop(R, amp)
        loops[f"ours_compiled_{p}"] = ours_loop(R, amp, "on")
        loops[f"floor_{p}"] = plain_loop(R, amp, floor=True)
        loops[f"plain_{p}"] = plain_loop(R, amp, floor=False)
    for step in loops.values():
        timed(step, batches, 0, 3)  # warm-up: first-touch pages, oneDNN kernels
    per: dict[str, list[float]] = {k: [] for k in loops}
    for r in range(rounds):
        for k, step in loops.items():
            per[k].append(timed(step, batches, r * block, block))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in per.items()), flush=True)
    res: dict = {k: {"samples_per_s": float(np.median(v)), "rounds": v} for k, v in per.items()}
    print(
        "\n| precision | ours (eager) | ours --compile on | floor | plain | ours / floor | compiled / floor |"
        " ours / plain |\n|---|---|---|---|---|---|---|---|"
    )
    for prec in (PRECISION[a] for a in amps):
        o, f, p = (per[f"{k}_{prec}"] for k in ("ours", "floor", "plain"))
        c = per[f"ours_compiled_{prec}"]
        for ours, name, base in (("ours", "floor", f), ("ours", "plain", p), ("ours_compiled", "floor", f)):
            ratios = [a / b for a, b in zip(per[f"{ours}_{prec}"], base)]
            res[f"{prec}_{ours}_vs_{name}_rounds"] = ratios
            res[f"{prec}_{ours}_vs_{name}"] = float(np.median(ratios))
        print(
            f"| {prec} | {np.median(o):,.0f} | {np.median(c):,.0f} | {np.median(f):,.0f} | {np.median(p):,.0f} | "
            f"**{res[f'{prec}_ours_vs_floor']:.2f}x** | **{res[f'{prec}_ours_compiled_vs_floor']:.2f}x** | "
            f"{res[f'{prec}_ours_vs_plain']:.2f}x |"
        )
    return res


def breakdown(R: int, B: int, zipf: float, amp: str, steps: int = 8, top: int = 10) -> dict:
    """Where a step goes (``torch.profiler``, self CPU time per operator, ms per step) for ours and the
    floor at ``amp``, profiled in turn over ``steps`` steps each (ours' C loops appear as ``mariana::*``
    ranges): {loop: {"ms_per_step": total,
    "ops": [[name, ms per step], ...] (the ``top`` largest)}}."""
    batches = make_batches(R, B, steps, zipf, seed=1)
    out = {}
    for name, step in (("ours", ours_loop(R, amp)), ("floor", plain_loop(R, amp, floor=True))):
        timed(step, batches, 0, 3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            timed(step, batches, 0, steps)
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in ops) / 1e3 / steps
        rows = [[e.key, round(e.self_cpu_time_total / 1e3 / steps, 2)] for e in ops[:top]]
        out[name] = {"ms_per_step": round(total, 2), "ops": rows}
        print(f"{name} {amp}: {total:.1f} ms/step of operators; " + ", ".join(f"{k} {v}" for k, v in rows))
    return out
