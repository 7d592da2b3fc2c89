"""ASR training throughput: the `mariana` acoustic DNN trained from the on-disk feature cache vs a plain
PyTorch loop over random tensors of the same shapes already on the device, same batch, same run.

Mariana path: FeatureCache (fp16 shards) -> length-bucketed IndexBatchLoader -> device -> splice (unfold) ->
DNN -> CTC -> the platform's optimizer (fused AdamW), bf16 autocast on GPU (as `mariana asr train` runs it).
Plain path: the same loss on the same batch shapes with nothing else: random frames already spliced to
[B, T, 440] and already on the device, with the Mariana path's own batches' lengths and digit targets -> the
same layer stack -> log-softmax -> the same CTC loss -> PyTorch's default AdamW; a second plain row uses the
fused AdamW Mariana uses (the like-for-like row: same optimiser, same loss, same shapes), so the table also
shows how much of the difference is the optimizer kernel.
Frames/s counts the valid frames of the batches (the same batches on both paths). The three loops run
``--rounds`` times one after the other and each loop's median round is reported. Usage::

    .venv/bin/python bench/asr_throughput.py [--data PREPARED] [--preset mariana] [--batch-size 4] [--steps 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_round, table, write_result  # noqa: E402
from mariana.apps.asr.configs import PRESETS  # noqa: E402
from mariana.apps.asr.data import prepare  # noqa: E402
from mariana.apps.asr.features import cached_features  # noqa: E402
from mariana.apps.asr.model import build_model  # noqa: E402
from mariana.apps.asr.train import (  # noqa: E402
    BLANK,
    BucketBatchSampler,
    UtteranceSet,
    collate,
    feature_settings,
    flush_denormals_on_cpu,
    make_step_fn,
)
from mariana.platform.core.loop import move_to  # noqa: E402
from mariana.platform.core.optim import build_optimizer  # noqa: E402
from mariana.platform.dp.sampler import IndexBatchLoader  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def autocast(device, on: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if on else contextlib.nullcontext()


def bench_mariana(cfg, dataset, device, steps, warmup, bf16, compile_):
    model = build_model(dataclasses.asdict(cfg), len(dataset.unit)).to(device)
    fwd = torch.compile(model) if compile_ else model
    opt = build_optimizer(cfg, model.parameters())  # as `mariana asr train` builds it (fused AdamW)
    step_fn = make_step_fn(dataclasses.replace(cfg, spec_augment=False))
    sampler = BucketBatchSampler(dataset.lengths, cfg.batch_size, seed=cfg.seed)
    loader = IndexBatchLoader(
        dataset,
        sampler,
        collate_fn=collate,
        num_workers=cfg.num_workers,
        pin_memory=device.type == "cuda",
    )
    frames, padded, t0, n = 0, 0, None, 0
    shapes = []  # (lengths, targets, target_lengths, padded T) of each timed batch, for the plain loop
    epoch, it = 0, iter(loader.iterate(0))
    while n < warmup + steps:
        try:
            batch = next(it)
        except StopIteration:
            epoch += 1
            it = iter(loader.iterate(epoch))
            continue
        if n == warmup:
            sync(device)
            t0 = time.perf_counter()
        batch = move_to(batch, device)
        with autocast(device, bf16):
            loss, _ = step_fn(fwd, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if n >= warmup:
            frames += int(batch["lengths"].sum())
            padded += batch["feats"].shape[0] * batch["feats"].shape[1]
            shapes.append(
                tuple(batch[k].cpu() for k in ("lengths", "targets", "target_lengths"))
                + (batch["feats"].shape[1],)
            )
        n += 1
    sync(device)
    wall = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    return {
        "frames_per_s": frames / wall,
        "frames_per_step": frames / steps,
        "padded_per_step": padded / steps,
        "step_s": wall / steps,
        "params": params,
        "shapes": shapes,
    }


def bench_plain(cfg, n_out, shapes, device, warmup, bf16, compile_, fused=False):
    """The plain loop over ``shapes`` (the Mariana path's timed batches: lengths, targets, target lengths,
    padded T), each batch's input drawn at random and spliced already; ``warmup`` untimed steps first."""
    d_in = cfg.num_mel_bins * (2 * cfg.context + 1)
    dims = [d_in] + [cfg.hidden] * cfg.layers
    layers = []
    for i in range(cfg.layers):
        layers += [torch.nn.Linear(dims[i], dims[i + 1]), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(dims[-1], max(n_out, cfg.output_units))).to(device)
    fwd = torch.compile(model) if compile_ else model
    # PyTorch's default AdamW (multi-tensor kernels); ``fused`` for the row that isolates that choice.
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True if fused else None)
    batches = [
        (torch.randn(len(lens), T, d_in, device=device), lens.to(device), tg.to(device), tl.to(device))
        for lens, tg, tl, T in shapes
    ]
    order = [batches[i % len(batches)] for i in range(warmup)] + batches
    for n, (x, lens, tg, tl) in enumerate(order):
        if n == warmup:
            sync(device)
            t0 = time.perf_counter()
        with autocast(device, bf16):
            logp = torch.log_softmax(fwd(x).float(), dim=-1)
        loss = torch.nn.functional.ctc_loss(
            logp.transpose(0, 1), tg, lens, tl, blank=0, reduction="mean", zero_infinity=True
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(device)
    wall = time.perf_counter() - t0
    frames = sum(int(lens.sum()) for lens, *_ in shapes)
    return {
        "frames_per_s": frames / wall,
        "frames_per_step": frames / len(shapes),
        "step_s": wall / len(shapes),
        "params": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data",
        default="",
        help="prepared ASR folder (OUT of `mariana asr prepare`); "
        "default: prepare a small one from ../shared/data/fsdd in a temp dir",
    )
    p.add_argument("--preset", default="mariana", help="model preset")
    p.add_argument(
        "--batch-size", type=int, default=0, help="utterances per step (0: 4 on CPU, preset on GPU)"
    )
    p.add_argument("--steps", type=int, default=0, help="timed steps (0: 3 on CPU, 50 on GPU)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="rounds of all three loops, one after the other; each loop's median round is reported, so "
        "the first round's cold start (allocator, page cache) counts for neither side (0: 3 on CPU, 1 on GPU)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile both models")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    cfg = PRESETS[args.preset]
    cfg = dataclasses.replace(
        cfg, batch_size=args.batch_size or (cfg.batch_size if gpu else 4), num_workers=2 if gpu else 0
    )
    steps = args.steps or (50 if gpu else 3)
    # As `mariana asr train` does on the CPU (see flush_denormals_on_cpu); the plain loop gets it too.
    flush_denormals_on_cpu(device)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(args.data) if args.data else Path(tmp) / "asr"
        if not args.data:
            prepare(
                ROOT.parent / "shared/data/fsdd/recordings", data, ["yweweler"], utterances=40, max_digits=5
            )
        cache = cached_features(data / "train", feature_settings(cfg), 2)
        vocab = [BLANK] + sorted({w for u in cache.utts for w in u["words"]})
        dataset = UtteranceSet(cache, vocab)
        runs: dict[str, list[dict]] = {"mariana": [], "plain": [], "fused": []}
        for r in range(args.rounds or (1 if gpu else 3)):
            m = bench_mariana(cfg, dataset, device, steps, args.warmup, gpu, args.compile)
            shapes = m.pop("shapes")  # the same batches every round (the sampler's seed is fixed)
            runs["mariana"].append(m)
            runs["plain"].append(bench_plain(cfg, len(vocab), shapes, device, args.warmup, gpu, args.compile))
            runs["fused"].append(
                bench_plain(cfg, len(vocab), shapes, device, args.warmup, gpu, args.compile, fused=True)
            )
            print(
                f"round {r + 1}: step s mariana {m['step_s']:.3f}, plain {runs['plain'][-1]['step_s']:.3f}, "
                f"plain fused {runs['fused'][-1]['step_s']:.3f}",
                flush=True,
            )
    m, plain, fused = (median_round(runs[k], "step_s") for k in ("mariana", "plain", "fused"))
    frames = int(round(m["frames_per_step"]))
    rows = [
        {
            "loop": "mariana (cache->splice->CTC)",
            "frames/s": f"{m['frames_per_s']:.0f}",
            "step s": f"{m['step_s']:.3f}",
            "frames/step": frames,
            "params M": f"{m['params'] / 1e6:.1f}",
        },
        {
            "loop": "plain, CTC, default AdamW",
            "frames/s": f"{plain['frames_per_s']:.0f}",
            "step s": f"{plain['step_s']:.3f}",
            "frames/step": frames,
            "params M": f"{plain['params'] / 1e6:.1f}",
        },
        {
            "loop": "plain, CTC, fused AdamW (like for like)",
            "frames/s": f"{fused['frames_per_s']:.0f}",
            "step s": f"{fused['step_s']:.3f}",
            "frames/step": frames,
            "params M": f"{fused['params'] / 1e6:.1f}",
        },
    ]
    ratio = m["frames_per_s"] / plain["frames_per_s"]
    print(table(rows, ["loop", "frames/s", "step s", "frames/step", "params M"]))
    path = write_result(
        "asr_throughput",
        {
            "preset": args.preset,
            "device": str(device),
            "bf16": gpu,
            "compile": args.compile,
            "steps": steps,
            "rounds": {k: [round(x["step_s"], 4) for x in v] for k, v in runs.items()},
            "batch_utterances": cfg.batch_size,
            "threads": torch.get_num_threads(),
            "mariana": m,
            "plain": plain,
            "plain_fused_adamw": fused,
            "ratio": ratio,
            "ratio_vs_plain_fused": m["frames_per_s"] / fused["frames_per_s"],
        },
    )
    print(f"wrote {path}")
    print(
        f"like for like (same CTC loss, same fused AdamW, same batches): mariana/plain "
        f"{m['frames_per_s'] / fused['frames_per_s']:.2f}x ({m['frames_per_s']:.0f} vs "
        f"{fused['frames_per_s']:.0f} frames/s); vs plain with PyTorch's default AdamW {ratio:.2f}x"
    )


if __name__ == "__main__":
    main()
