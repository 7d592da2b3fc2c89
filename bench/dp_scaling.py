"""Data-parallel scaling on this machine, and a ring-all-reduce model of larger clusters.

Measures, in one run:
1. training throughput of the acoustic-DNN-shaped MLP (440 -> 7x2048 -> 12000, 50.7M parameters; or
   ``--narrow`` for 440 -> 7x1024 -> 3000) with a plain PyTorch loop (1 process x 1 thread: the reference),
   Mariana's data-parallel framework with 1 worker, and with 2 workers x 1 thread each (torchrun + gloo),
   against the like-for-like baseline on 2 cores: one plain process x 2 threads on the same global batch;
2. fp32 vs bf16 gradient communication: bytes and all-reduce time per step;
3. gloo all-reduce time against message size on loopback, with the ring model t = a + 2(N-1)/N * S/B
   fitted beside it;
4. a PREDICTION of scaling efficiency for N = 2..64 GPUs from the ring model with a stated link
   bandwidth and per-step compute time (no overlap of communication with backward: a lower bound).

Usage: ``.venv/bin/python bench/dp_scaling.py [--batch 512] [--steps 4] [--narrow]``
Writes bench/results/dp_scaling-cpu.json (or -gpu) and prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_result  # noqa: E402

WIDE = (440, 2048, 7, 12000)
NARROW = (440, 1024, 7, 3000)


def build_mlp(shape) -> nn.Module:
    d_in, width, layers, d_out = shape
    dims = [d_in] + [width] * layers
    mods: list[nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        mods += [nn.Linear(a, b), nn.ReLU()]
    mods.append(nn.Linear(width, d_out))
    return nn.Sequential(*mods)


def train_steps(model, ctx_device, batch, steps, shape, world=1):
    """Returns (seconds per step over the timed steps, comm stats per step)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, shape[0], device=ctx_device)
    y = torch.randint(0, shape[3], (batch,), device=ctx_device)
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for i in range(steps + 1):  # the first step is warm-up
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if i == 0 and hasattr(model, "comm_stats"):
            model.comm_stats.take()
    return sum(times[1:]) / steps


def worker_main(args) -> None:
    """Inside torchrun: Mariana's data-parallel framework around the same MLP."""
    torch.set_num_threads(1)
    from mariana.platform.dp.ddp import apply_data_parallel
    from mariana.platform.runtime.dist import init_distributed, teardown

    ctx = init_distributed("cpu", timeout_s=600, watchdog=False)
    try:
        shape = NARROW if args.narrow else WIDE
        torch.manual_seed(0)
        out = {}
        if args.mode == "train":
            model = apply_data_parallel(build_mlp(shape), ctx, grad_comm=args.grad_comm)
            sec = train_steps(model, ctx.device, args.batch, args.steps, shape)
            comm_s, comm_bytes = model.comm_stats.take()
            out = {
                "sec_per_step": sec,
                "comm_s_per_step": comm_s / args.steps,
                "comm_bytes_per_step": comm_bytes // args.steps,
            }
        else:  # all-reduce sweep
            import torch.distributed as dist

            sweep = []
            for p in range(10, 29, 2):  # 1 KiB .. 256 MiB
                n = (1 << p) // 4
                t = torch.ones(n)
                reps = max(2, min(50, (1 << 24) // (1 << p) * 4))
                dist.all_reduce(t)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    dist.all_reduce(t)
                sweep.append({"bytes": 1 << p, "seconds": (time.perf_counter() - t0) / reps})
            out = {"sweep": sweep}
        if ctx.is_main:
            Path(args.result).write_text(json.dumps(out))
    finally:
        teardown(ctx)


def launch(n: int, extra: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = f.name
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(n),
        __file__,
        "--worker",
        "--result",
        result,
        *extra,
    ]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return json.loads(Path(result).read_text())


def fit_ring(sweep: list[dict], n: int) -> tuple[float, float]:
    """Least squares for t = a + k * S with k = 2(N-1)/N / B; returns (a seconds, B bytes/s)."""
    import numpy as np

    s = np.array([r["bytes"] for r in sweep], dtype=float)
    t = np.array([r["seconds"] for r in sweep])
    A = np.stack([np.ones_like(s), s], 1)
    (a, k), *_ = np.linalg.lstsq(A, t, rcond=None)
    return max(a, 0.0), 2 * (n - 1) / n / k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=512, help="samples per worker per step")
    ap.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up step)")
    ap.add_argument("--narrow", action="store_true", help="440 -> 7x1024 -> 3000 instead of the 50.7M model")
    ap.add_argument(
        "--link-gbps", type=float, default=400.0, help="assumed per-GPU link for the prediction, Gbit/s"
    )
    ap.add_argument(
        "--hop-latency-us",
        type=float,
        default=10.0,
        help="assumed latency per ring hop between GPUs for the prediction, microseconds",
    )
    ap.add_argument(
        "--gpu-step-ms",
        type=float,
        default=0.0,
        help="per-step compute time per GPU for the prediction (0: from FLOPs at --gpu-tflops)",
    )
    ap.add_argument("--gpu-tflops", type=float, default=400.0, help="achieved bf16 TFLOP/s assumed per GPU")
    ap.add_argument("--gpu-batch", type=int, default=8192, help="per-GPU batch for the prediction")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="train", help=argparse.SUPPRESS)
    ap.add_argument("--grad-comm", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)

    shape = NARROW if args.narrow else WIDE
    n_params = sum(p.numel() for p in build_mlp(shape).parameters())
    common = ["--batch", str(args.batch), "--steps", str(args.steps)] + (["--narrow"] if args.narrow else [])

    # 1. Plain PyTorch reference: one process, one thread, no framework.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = train_steps(build_mlp(shape), torch.device("cpu"), args.batch, args.steps, shape)
    # The like-for-like baseline of 2 workers on 2 cores: one process using both cores on their global batch.
    torch.set_num_threads(2)
    torch.manual_seed(0)
    plain2 = train_steps(build_mlp(shape), torch.device("cpu"), 2 * args.batch, args.steps, shape)
    torch.set_num_threads(1)
    one = launch(1, common)
    two = launch(2, common)
    two_bf16 = launch(2, [*common, "--grad-comm", "bf16"])
    sweep = launch(2, ["--mode", "allreduce"])["sweep"]
    alpha, bw = fit_ring(sweep, 2)

    rows = [
        {"run": "plain PyTorch 1x1 thread", "samples/s": round(args.batch / plain, 1), "vs plain": "1.00x"},
        {
            "run": "plain PyTorch 1x2 threads, 2x batch",
            "samples/s": round(2 * args.batch / plain2, 1),
            "vs plain": f"{2 * plain / plain2:.2f}x",
        },
        {
            "run": "mariana 1 worker",
            "samples/s": round(args.batch / one["sec_per_step"], 1),
            "vs plain": f"{plain / one['sec_per_step']:.2f}x",
        },
        {
            "run": "mariana 2 workers fp32",
            "samples/s": round(2 * args.batch / two["sec_per_step"], 1),
            "vs plain": f"{2 * plain / two['sec_per_step']:.2f}x",
            "comm MB/step": round(two["comm_bytes_per_step"] / 1e6, 1),
            "comm s/step": round(two["comm_s_per_step"], 3),
        },
        {
            "run": "mariana 2 workers bf16",
            "samples/s": round(2 * args.batch / two_bf16["sec_per_step"], 1),
            "vs plain": f"{2 * plain / two_bf16['sec_per_step']:.2f}x",
            "comm MB/step": round(two_bf16["comm_bytes_per_step"] / 1e6, 1),
            "comm s/step": round(two_bf16["comm_s_per_step"], 3),
        },
    ]
    sweep_rows = [
        {
            "bytes": r["bytes"],
            "measured ms": round(r["seconds"] * 1e3, 3),
            "ring model ms": round((alpha + 2 * (2 - 1) / 2 * r["bytes"] / bw) * 1e3, 3),
        }
        for r in sweep
    ]
    # Prediction for N GPUs: compute per step (FLOPs 6*P*batch at the assumed rate) + un-overlapped ring
    # all-reduce of the bf16 gradients: t = 2(N-1) * hop latency + 2(N-1)/N * S / B (assumed link B).
    link = args.link_gbps * 1e9 / 8
    compute = (
        args.gpu_step_ms / 1e3
        if args.gpu_step_ms
        else 6 * n_params * args.gpu_batch / (args.gpu_tflops * 1e12)
    )
    grad_bytes = 2 * n_params
    pred = []
    for n in (2, 4, 8, 16, 32, 64):
        comm = 2 * (n - 1) * args.hop_latency_us * 1e-6 + 2 * (n - 1) / n * grad_bytes / link
        pred.append(
            {
                "gpus": n,
                "compute ms": round(compute * 1e3, 2),
                "allreduce ms": round(comm * 1e3, 2),
                "efficiency": f"{compute / (compute + comm):.1%}",
            }
        )

    print(f"Data-parallel scaling, MLP {shape} = {n_params / 1e6:.1f}M parameters, batch {args.batch}/worker")
    print(table(rows, ["run", "samples/s", "vs plain", "comm MB/step", "comm s/step"]))
    print(
        f"\nlike for like on 2 cores (global batch {2 * args.batch}): mariana 2 workers x 1 thread vs plain "
        f"1 process x 2 threads: {plain2 / two['sec_per_step']:.2f}x (fp32 comm), "
        f"{plain2 / two_bf16['sec_per_step']:.2f}x (bf16 comm)"
    )
    print(
        f"\nscaling 2 workers vs mariana 1 worker: {one['sec_per_step'] * 2 / two['sec_per_step']:.2f}x (fp32), "
        f"{one['sec_per_step'] * 2 / two_bf16['sec_per_step']:.2f}x (bf16 comm)"
    )
    print(
        f"\ngloo all-reduce on loopback, 2 ranks; fitted ring model: latency {alpha * 1e6:.0f} us, "
        f"bus bandwidth {bw / 1e9:.2f} GB/s"
    )
    print(table(sweep_rows, ["bytes", "measured ms", "ring model ms"]))
    print(
        f"\nPREDICTION (not measured): bf16 gradients over a {args.link_gbps:.0f} Gbit/s link per GPU, "
        f"{args.hop_latency_us:.0f} us per ring hop, {compute * 1e3:.1f} ms compute per step "
        f"({args.gpu_batch} samples at {args.gpu_tflops:.0f} TFLOP/s), no comm/compute overlap"
    )
    print(table(pred, ["gpus", "compute ms", "allreduce ms", "efficiency"]))
    path = write_result(
        "dp_scaling",
        {
            "command": "python bench/dp_scaling.py " + " ".join(sys.argv[1:]),
            "model_shape": shape,
            "params": n_params,
            "batch_per_worker": args.batch,
            "steps": args.steps,
            "throughput": rows,
            "scaling_2_vs_1": one["sec_per_step"] * 2 / two["sec_per_step"],
            "two_workers_vs_plain_1x2_threads": plain2 / two["sec_per_step"],
            "two_workers_bf16_vs_plain_1x2_threads": plain2 / two_bf16["sec_per_step"],
            "scaling_2_vs_1_bf16": one["sec_per_step"] * 2 / two_bf16["sec_per_step"],
            "allreduce_sweep": sweep_rows,
            "ring_fit": {"latency_s": alpha, "bus_bandwidth_Bps": bw},
            "prediction": {
                "assumptions": {
                    "link_gbps": args.link_gbps,
                    "hop_latency_us": args.hop_latency_us,
                    "compute_s": compute,
                    "gpu_batch": args.gpu_batch,
                    "gpu_tflops": args.gpu_tflops,
                    "overlap": "none",
                },
                "rows": pred,
            },
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
