"""Vision input-pipeline throughput: end-to-end from JPEG vs the same model on synthetic GPU tensors.

For each case (model, image size) in the same run:
- ``synthetic``: training steps on uint8 batches already in device memory (augment + normalise + fwd/bwd
  + optimizer step): the compute ceiling;
- ``jpeg``: the same steps fed from JPEG bytes: the tar shard is indexed, bytes are read by offset in
  DataLoader workers and decoded per step (GPU: batched nvJPEG ``decode_jpeg(device='cuda')`` in the prefetch thread; CPU:
  ``decode_image`` in the workers), with pinned memory, non-blocking copies and a prefetch thread;
  the ratio ``jpeg / synthetic`` is the goal (>= 0.8).
Cases: the CIFAR-10 tar at 32 px, and 224 px JPEGs made by upscaling and re-encoding CIFAR images
(written once to a temporary tar). Also (CPU, optional) the pipelined vs unpipelined step time of a
2-stage model-parallel job and its memory ratio, via the real CLI, for both ``--pipeline-schedule``
values (torch.distributed.pipelining 1F1B and GPipe), and the pipeline schedules side by side in the same
two processes (torch 1F1B, torch GPipe, the hand-written P2P GPipe; interleaved, so machine noise hits
all three alike).

    .venv/bin/python bench/vision_throughput.py                 # GPU when available, else a small CPU run
    .venv/bin/python bench/vision_throughput.py --pipeline      # + K=2 pipelined/unpipelined on CPU
    .venv/bin/python bench/vision_throughput.py --device cpu --steps 4 --workers 1 --pipeline   # ~2 min, 2 cores
    .venv/bin/python bench/vision_throughput.py --models fastnet@32 --cached-epochs 10   # JPEG-to-device

Writes ``bench/results/vision_throughput-{cpu,cuda}.json`` (``--models none``:
``vision_throughput-cpu-pipeline.json``) and prints a summary line last.

GPU time-to-94 % recipe (the ``gpu94`` preset, ResNet-9, bf16 autocast, channels-last, torch.compile)::

    mariana vision train --preset gpu94 --data ../shared/data/cifar10/train.tar \
        --eval-data ../shared/data/cifar10/test-dev.tar --out runs/gpu94 --device cuda
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402
from vision_steady import steady_case  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("MARIANA_DATA", ROOT.parent / "shared" / "data"))


def make_224_tar(src_tar: Path, out: Path, n: int) -> Path:
    """Upscale the first ``n`` CIFAR images to 224 px (bilinear) and re-encode as JPEG (quality 90)."""
    from torchvision.io import decode_jpeg, encode_jpeg
    from torchvision.transforms.v2 import functional as TF

    with tarfile.open(src_tar) as src, tarfile.open(out, "w") as dst:
        k = 0
        for m in src:
            if not m.isfile() or k >= n:
                continue
            img = decode_jpeg(torch.frombuffer(bytearray(src.extractfile(m).read()), dtype=torch.uint8))
            big = TF.resize(img, [224, 224], antialias=True)
            data = encode_jpeg(big, quality=90).numpy().tobytes()
            info = tarfile.TarInfo(m.name)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
            k += 1
    return out


def build(name: str, size: int, device, channels_last: bool, compile_: bool):
    from mariana.apps.vision.model import build_model

    model = build_model(name, 10, size, dropout=0.0).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    fwd = torch.compile(model) if compile_ else model
    return fwd, opt


def train_steps(fwd, opt, batches, device, amp: bool, channels_last: bool, pad: int) -> tuple[int, float]:
    """Run one training step per batch from the iterator; returns (images, seconds)."""
    from mariana.apps.vision.data import augment_batch, normalize

    n, t0, first = 0, None, True
    ctx = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if amp
        else torch.autocast(device.type, enabled=False)
    )
    for x, y in batches:
        x = normalize(augment_batch(x, pad=pad), channels_last)
        with ctx:
            loss = F.cross_entropy(fwd(x).float(), y.to(device, non_blocking=True))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if first:  # exclude warm-up (cudnn autotune, compile) from the timing
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0, first = time.perf_counter(), False
            continue
        n += y.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return n, time.perf_counter() - (t0 or time.perf_counter())


def jpeg_batches(tar: Path, size: int, batch: int, steps: int, device, workers: int):
    """Batches from the tar: (uint8 [B,3,S,S] on device | list of bytes for GPU decode, labels)."""
    from mariana.apps.vision.data import StreamingImages, TarSource, collate_stream
    from mariana.platform.core.prefetch import Prefetcher

    src = TarSource(tar)
    gpu = device.type == "cuda"
    ds = StreamingImages(src, size, decode=not gpu)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(src), generator=g).tolist()
    idx = [order[(i * batch) % len(order) :][:batch] for i in range(steps)]
    idx = [b for b in idx if len(b) == batch]
    loader = torch.utils.data.DataLoader(
        ds,
        batch_sampler=idx,
        collate_fn=collate_stream,
        num_workers=workers,
        pin_memory=gpu,
        prefetch_factor=4 if workers else None,
        persistent_workers=False,
    )

    def gen():
        from mariana.apps.vision.data import gpu_decode_batch

        transform = gpu_decode_batch(size, device) if gpu else None
        for x, y, _bad in Prefetcher(iter(loader), depth=4, device=device, transform=transform):
            yield x, y

    return gen()


def synthetic_batches(size: int, batch: int, steps: int, device):
    x = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    for _ in range(steps):
        yield x, y


def cached_batches(images: torch.Tensor, labels: torch.Tensor, batch: int, steps: int):
    """Batches indexed from a decoded set on the device by a device permutation (the decode-once path)."""
    perm = torch.randperm(len(images), device=images.device)
    for i in range(steps):
        lo = (i * batch) % (len(images) - batch + 1)
        idx = perm[lo : lo + batch]
        yield images[idx], labels[idx]


def timed_decode(tar: Path, size: int, device, workers: int):
    """``decode_all`` of the whole tar onto ``device`` (index + read + decode + copy); returns (data, s)."""
    from mariana.apps.vision.data import decode_all, open_source

    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    data = decode_all(open_source(tar), size, device, workers=workers)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return data, time.perf_counter() - t0


def index_times(tar: Path) -> dict:
    """Seconds to index the tar: the header walk `TarSource` uses vs ``tarfile`` (the previous index)."""
    from mariana.apps.vision.tarindex import scan_tar

    t0 = time.perf_counter()
    scan_tar(tar)
    t1 = time.perf_counter()
    with tarfile.open(tar, "r:") as tf:
        [m.offset_data for m in tf if m.isfile()]
    return {"index_s": t1 - t0, "index_tarfile_s": time.perf_counter() - t1}


def cached_case(
    name, size, tar, batch, steps, device, amp, channels_last, compile_, epochs: int, workers: list[int]
) -> dict:
    """The decode-once path: every JPEG of ``tar`` decoded once onto ``device`` (``workers[0]`` > 0: on the
    CPU in that many worker processes, chunks copied to the device as they come; 0: batched nvJPEG on a
    GPU), then training steps indexed from that set. ``workers[1:]``: other worker counts, decode time
    only (``decode_s_by_workers``), measured before the headline one. ``jpeg_to_device_img_s`` = the training rate of ``epochs``
    epochs fed from the JPEGs with the one decode included: ``E*N / (decode_s + E*N / cached_img_s)``;
    ``ratio`` compares it with the synthetic rate (the same steps on one batch already on the device)."""
    res = {"model": name, "image_size": size, "batch": batch, "steps": steps, "path": "decode-once"}
    res["decode_workers"] = workers[0]
    res.update(index_times(tar))
    fwd, opt = build(name, size, device, channels_last, compile_)
    n, s = train_steps(fwd, opt, synthetic_batches(size, batch, steps, device), device, amp, channels_last, 0)
    res["synthetic_img_s"] = n / s
    res["decode_s_by_workers"] = {w: timed_decode(tar, size, device, w)[1] for w in workers[1:]}
    data, res["decode_s"] = timed_decode(tar, size, device, workers[0])
    res["images"] = len(data)
    res["decode_img_s"] = len(data) / res["decode_s"]
    images, labels = data.images.to(device), data.labels.to(device)
    n, s = train_steps(fwd, opt, cached_batches(images, labels, batch, steps), device, amp, channels_last, 0)
    res["cached_img_s"] = n / s
    total = epochs * len(data)
    res["epochs"] = epochs
    res["jpeg_to_device_img_s"] = total / (res["decode_s"] + total / res["cached_img_s"])
    res["ratio"] = res["jpeg_to_device_img_s"] / res["synthetic_img_s"]
    print(json.dumps(res), file=sys.stderr, flush=True)
    return res


def run_case(name, size, tar, batch, steps, device, workers, amp, channels_last, compile_):
    res = {"model": name, "image_size": size, "batch": batch, "steps": steps}
    pad = size // 8
    fwd, opt = build(name, size, device, channels_last, compile_)
    n, s = train_steps(
        fwd, opt, synthetic_batches(size, batch, steps, device), device, amp, channels_last, pad
    )
    res["synthetic_img_s"] = n / s
    n, s = train_steps(
        fwd, opt, jpeg_batches(tar, size, batch, steps, device, workers), device, amp, channels_last, pad
    )
    res["jpeg_img_s"] = n / s
    res["ratio"] = res["jpeg_img_s"] / res["synthetic_img_s"]
    print(json.dumps(res), file=sys.stderr, flush=True)
    return res


def _cli_train(run: Path, extra: list[str]) -> list[str]:
    """The `mariana vision train` command of the CPU pipeline measurements (mariana-cnn-32, batch 32)."""
    return [
        sys.executable,
        "-m",
        "mariana.platform.cli",
        "vision",
        "train",
        "--data",
        str(DATA / "cifar10" / "train.tar"),
        "--out",
        str(run),
        "--model",
        "mariana-cnn-32",
        "--limit",
        "1024",
        "--batch-size",
        "32",
        "--max-steps",
        "8",
        "--no-progress",
        "--device",
        "cpu",
        "--optimizer",
        "adam",
        "--augment",
        "none",
        *extra,
    ]


def unsplit_bench(out_dir: Path) -> dict:
    """CPU, 1 process x 1 thread: the same model and batch without model parallelism (the reference
    for the K=2 step times: each pipeline stage also gets one thread)."""
    run = out_dir / "unsplit"
    cmd = _cli_train(run, ["--workers", "1", "--log-every", "1"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in recs if "step_time_s" in r][1:]  # drop the warm-up step
    return {"step_time_s": sum(times) / max(1, len(times))}


def pipeline_bench(out_dir: Path, balance: str = "params") -> dict:
    """CPU, 2 processes: K=2 mariana-cnn-32 with 4 micro-batches (pipelined; 1F1B, the default, and
    GPipe) vs 1 (unpipelined: the hand-written GPipe with one micro-batch, as torch's schedules need
    micro-batches >= stages)."""
    res = {"stage_balance": balance}
    for m, schedule in ((1, "1f1b"), (4, "1f1b"), (4, "gpipe")):
        key = f"m{m}" if schedule == "1f1b" else f"m{m}_{schedule}"
        run = out_dir / f"pp-{balance}-{key}"
        extra = ["--workers", "2", "--model-parallel", "2", "--micro-batches", str(m)]
        cmd = _cli_train(run, [*extra, "--stage-balance", balance, "--pipeline-schedule", schedule])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
        final = json.loads((run / "metrics.json").read_text())
        res[f"step_time_s_{key}"] = final["step_time_s"]
        res[f"schedule_{key}"] = final.get("pipeline_schedule", "")
        reps = [json.loads(p.read_text()) for p in sorted((run / "logs").glob("pipeline-rank-*.json"))]
        tot = sum(r["param_bytes"] + r["optimizer_state_bytes"] for r in reps)
        res["memory_ratio_max_rank"] = max(
            (r["param_bytes"] + r["optimizer_state_bytes"]) / tot for r in reps
        )
    res["pipelined_speedup"] = res["step_time_s_m1"] / res["step_time_s_m4"]
    return res


SCHEDULE_BATCH, SCHEDULE_MICRO, SCHEDULE_ROUNDS = 32, 4, 12


def schedule_worker(out: Path) -> None:
    """Under torchrun (2 processes, gloo): one K=2 mariana-cnn-32 split, its forward+backward step on a
    batch of 32 in 4 micro-batches by each schedule in turn, ``SCHEDULE_ROUNDS`` rounds (the first is
    warm-up); rank 0 writes the per-schedule step times to ``out``."""
    import torch.distributed as dist
    from mariana.apps.vision.model import mariana_cnn_32
    from mariana.platform.pipeline import parallelize_pipeline
    from mariana.platform.runtime.dist import ParallelDims, init_distributed, teardown

    torch.set_num_threads(1)
    ctx = init_distributed("cpu", 120.0, watchdog=False)
    try:
        torch.manual_seed(0)
        model = mariana_cnn_32(10, 0.0)
        mesh = ParallelDims(world_size=ctx.world_size, mp=2).build_mesh("cpu")
        g = torch.Generator().manual_seed(1)
        x = torch.randn(SCHEDULE_BATCH, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (SCHEDULE_BATCH,), generator=g)
        pps = {
            name: parallelize_pipeline(
                model, mesh, ctx.device, F.cross_entropy, SCHEDULE_MICRO, schedule=name
            )
            for name in ("1f1b", "gpipe", "p2p")
        }
        times: dict[str, list[float]] = {name: [] for name in pps}
        for _ in range(SCHEDULE_ROUNDS):
            for name, pp in pps.items():
                dist.barrier()
                t0 = time.perf_counter()
                pp.run_schedule(x if pp.is_first else None, y if pp.is_last else None, SCHEDULE_BATCH)
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
                pp.stage.zero_grad(set_to_none=True)
        if dist.get_rank() == 0:
            res = {}
            for name, ts in times.items():
                steady = sorted(ts[1:])
                med = steady[len(steady) // 2]
                res[name] = {
                    "schedule": pps[name].last_schedule,
                    "median_step_s": med,
                    "img_s": SCHEDULE_BATCH / med,
                }
            out.write_text(json.dumps(res))
    finally:
        teardown(ctx)


def schedule_bench(out_dir: Path) -> dict:
    """The pipeline schedules side by side (`schedule_worker`): torch 1F1B and GPipe vs the hand-written."""
    out = out_dir / "schedules.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    subprocess.run(
        [*cmd, __file__, "--schedule-worker", str(out)], cwd=ROOT, env=env, check=True, capture_output=True
    )
    res = json.loads(out.read_text())
    res["setup"] = (
        f"mariana-cnn-32, K=2 (params cut), batch {SCHEDULE_BATCH}, {SCHEDULE_MICRO} micro-batches, forward+backward, "
        f"2 processes x 1 thread, median of {SCHEDULE_ROUNDS - 1} interleaved rounds"
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DATA / "cifar10" / "train.tar"), help="CIFAR-10 train tar")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="compute device")
    ap.add_argument("--steps", type=int, default=0, help="steps per measurement (0: 60 on GPU, 6 on CPU)")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="DataLoader workers")
    ap.add_argument(
        "--models",
        default="",
        help="comma list of model@size (default GPU: resnet9@32,alexnet@224,mariana-cnn@224; CPU: "
        "cifar-fast@32,mariana-cnn@224); 'none' with --pipeline for the pipeline measurement only",
    )
    ap.add_argument(
        "--pipeline", action="store_true", help="also measure K=2 pipelined vs unpipelined on CPU"
    )
    ap.add_argument("--compile", action="store_true", help="torch.compile the models (GPU)")
    ap.add_argument(
        "--cached-epochs",
        type=int,
        default=0,
        help="measure the decode-once path instead (whole tar decoded onto the device, then steps from it), "
        "its rate over N epochs with the decode included",
    )
    ap.add_argument(
        "--decode-workers",
        default=str(min(8, os.cpu_count() or 1)),
        help="--cached-epochs: CPU processes decoding the JPEGs (0: in this process, nvJPEG on a GPU); a "
        "comma list: the first is the headline, the others are timed too (decode only)",
    )
    ap.add_argument("--batch", type=int, default=0, help="images per step (0: the defaults below)")
    ap.add_argument(
        "--out", default="", help="JSON path (default bench/results/vision_throughput-DEVICE.json)"
    )
    ap.add_argument(
        "--steady",
        default="",
        help="also time the steady-state training rate of this preset's path against the plain loop "
        "(bench/vision_steady.py; gpu94 on a GPU, small on the CPU); with --models none: that row only",
    )
    ap.add_argument("--steady-rounds", type=int, default=5, help="--steady: interleaved rounds")
    ap.add_argument("--steady-warmup", type=int, default=3, help="--steady: untimed steps of each side")
    ap.add_argument("--steady-limit", type=int, default=0, help="--steady: images decoded (0: all)")
    ap.add_argument("--schedule-worker", default="", help=argparse.SUPPRESS)  # internal: under torchrun
    args = ap.parse_args()
    if args.schedule_worker:
        schedule_worker(Path(args.schedule_worker))
        return
    dev = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    gpu = dev.type == "cuda"
    if gpu:
        torch.backends.cudnn.benchmark = True
    steps = args.steps or (60 if gpu else 6)
    cases = args.models or (
        "resnet9@32,alexnet@224,mariana-cnn@224" if gpu else "cifar-fast@32,mariana-cnn@224"
    )
    results = {
        "machine": machine(),
        "command": "bench/vision_throughput.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "torch": torch.__version__,
        "cases": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        tar224 = None
        for spec in [] if cases == "none" else cases.split(","):
            name, size = spec.split("@")
            size = int(size)
            batch = args.batch or ((512 if size <= 64 else 256) if gpu else (64 if size <= 64 else 8))
            if size > 32:
                if tar224 is None:
                    # GPU: enough distinct images that the page cache, not the tar, is measured; CPU: just the run's
                    n224 = max(2000, batch * (steps + 2)) if gpu else batch * (steps + 2)
                    tar224 = make_224_tar(Path(args.data), Path(tmp) / "cifar224.tar", n224)
                tar = tar224
            else:
                tar = Path(args.data)
            if args.cached_epochs:
                case = cached_case(
                    name,
                    size,
                    tar,
                    batch,
                    steps,
                    dev,
                    gpu,
                    True,
                    args.compile,
                    args.cached_epochs,
                    [int(w) for w in args.decode_workers.split(",")],
                )
            else:
                case = run_case(name, size, tar, batch, steps, dev, args.workers, gpu, True, args.compile)
            results["cases"].append(case)
        if args.steady:
            results["steady"] = steady_case(
                args.data,
                args.steady,
                dev,
                steps,
                args.steady_rounds,
                batch=args.batch,
                limit=args.steady_limit,
                warmup=args.steady_warmup,
            )
        if args.pipeline:
            results["pipeline_schedules_cpu"] = schedule_bench(Path(tmp))
            results["pipeline_cpu"] = [pipeline_bench(Path(tmp), b) for b in ("params", "time")]
            results["unsplit_cpu"] = unsplit_bench(Path(tmp))
    # a GPU run keeps the CPU record; a pipeline-only run (--models none) keeps the full one
    name = f"vision_throughput-{dev.type}" + ("-pipeline" if cases == "none" else "")
    if cases == "none" and not args.pipeline:  # the steady row alone
        name = f"vision_steady-{'gpu' if gpu else 'cpu'}"
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    summary = ", ".join(
        f"{c['model']}@{c['image_size']}: jpeg {c.get('jpeg_img_s', c.get('jpeg_to_device_img_s')):.0f} img/s "
        f"= {100 * c['ratio']:.0f}% of synthetic {c['synthetic_img_s']:.0f}"
        + (
            f" (decode-once, {c['epochs']} epochs, decode {c['decode_img_s']:.0f} img/s with "
            f"{c['decode_workers'] or 'no'} workers"
            + "".join(
                f"; {w or 'no'} workers {c['images'] / s:.0f} img/s"
                for w, s in c["decode_s_by_workers"].items()
            )
            + f"; index {c['index_s']:.2f} s, tarfile {c['index_tarfile_s']:.2f} s"
            + ")"
            if "epochs" in c
            else ""
        )
        for c in results["cases"]
    )
    if "pipeline_cpu" in results:
        for p in results["pipeline_cpu"]:
            summary += (
                f"; K=2 ({p['stage_balance']}-balanced) pipelined speed-up {p['pipelined_speedup']:.2f}x, "
                f"memory {100 * p['memory_ratio_max_rank']:.0f}%"
            )
        summary += f"; unsplit 1-process step {results['unsplit_cpu']['step_time_s']:.2f} s"
        summary += "; schedules (same processes): " + ", ".join(
            f"{v['schedule']} {v['img_s']:.1f} img/s"
            for k, v in results["pipeline_schedules_cpu"].items()
            if k != "setup"
        )
    if "steady" in results:
        c = results["steady"]
        summary += (", " if summary else "") + (
            f"steady {c['preset']} ({c['model']}, batch {c['batch']}): ours {c['ours_img_s']:.0f} img/s vs plain "
            f"{c['plain_img_s']:.0f}: {c['ratio']:.3f}x (median of {len(c['rounds'])} interleaved rounds)"
        )
    print(summary)


if __name__ == "__main__":
    main()
