"""Our ``fast`` preset against the airbench paper's own ``train94`` (PyPI ``airbench``, a bench-only extra:
``pip install -e '.[bench]'``), on the same tars, device, epochs and evaluation images, seeds interleaved
(airbench seed 0, ours seed 0, airbench seed 1, ...) so that the machine's load hits both sides alike.

airbench side: its ``make_net94`` and ``CifarLoader`` unchanged except device and dtype (the package builds
the net with ``.half().cuda()``; on the CPU the bench keeps it on the CPU in fp32 and casts the loader's
images to fp32); evaluation with its own ``evaluate(tta_level=2)`` (flip + translate). On CUDA the training
is ``airbench.train94`` itself; on the CPU the bench runs the same loop step for step (``airbench.utils.
train`` times itself with CUDA events, so it cannot run there): the same optimizer groups, triangular
schedule, Lookahead, whitening init and whitening-bias freeze. The training images are the tars decoded once
by our decoder (``decode_all``), written in airbench's ``train.pt``/``test.pt`` layout.

Our side: ``mariana vision train --preset fast`` in this process (the one Trainer), eval with ``crops`` TTA.
Training seconds exclude compile for both: neither side compiles unless ``--compile`` (then one untimed
warm-up run per side comes first; airbench has no compile, its warm-up only primes cuDNN).
``--batch-size`` other than 1024 scales our learning rate by batch/1024 (airbench's rates are per example).

Usage: ``python bench/vision_airbench.py [--device cpu] [--seeds 3] [--epochs 1] [--limit N]``; prints one
table and writes ``bench/results/vision_airbench-{cpu,gpu}.json`` (or ``--json PATH``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, table, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "cifar10"


def need_airbench():
    try:
        import airbench  # noqa: F401
    except ImportError:
        print(
            "vision_airbench: the PyPI package 'airbench' is not installed (a bench-only extra): "
            "pip install -e '.[bench]' or pip install airbench",
            file=sys.stderr,
        )
        sys.exit(2)
    import airbench

    return airbench


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ airbench
@contextlib.contextmanager
def on_device(device: torch.device):
    """``make_net94`` calls ``.half().cuda()``: on a CPU both become no-ops (fp32, CPU); on CUDA unchanged."""
    if device.type == "cuda":
        yield
        return
    with (
        mock.patch.object(nn.Module, "half", lambda self: self),
        mock.patch.object(nn.Module, "cuda", lambda self, *a, **k: self),
    ):
        yield


def write_airbench_data(folder: Path, train, test) -> None:
    """Our decoded sets (uint8 [N,3,S,S]) in airbench's ``train.pt``/``test.pt`` layout (uint8 [N,S,S,3])."""
    for name, d in (("train.pt", train), ("test.pt", test)):
        images = d.images.permute(0, 2, 3, 1).contiguous().cpu()
        torch.save({"images": images, "labels": d.labels.cpu(), "classes": d.classes}, folder / name)


def airbench_loader(ab, folder: Path, train: bool, batch_size: int, device: torch.device):
    from airbench.lib_airbench94 import hyp

    kw = {"aug": hyp["aug"], "altflip": True} if train else {}
    loader = ab.CifarLoader(str(folder), train=train, batch_size=batch_size, gpu=device, **kw)
    if device.type != "cuda":
        loader.images = loader.images.float()  # the package keeps fp16 images (for its .half() net)
    return loader


def train94_cpu(ab, loader, epochs: int, device: torch.device) -> nn.Module:
    """``airbench.utils.train`` for ``make_net94`` step for step, timed by the caller instead of CUDA events."""
    from airbench.lib_airbench94 import hyp, make_net94
    from airbench.utils import LookaheadState, init_whitening_conv

    o = hyp["opt"]
    kilostep_scale = 1024 * (1 + 1 / (1 - o["momentum"]))
    lr = o["lr"] / kilostep_scale
    wd = o["weight_decay"] * loader.batch_size / kilostep_scale
    lr_biases = lr * o["bias_scaler"]
    loss_fn = nn.CrossEntropyLoss(label_smoothing=o["label_smoothing"], reduction="none")
    total = math.ceil(len(loader) * epochs)
    with on_device(device):
        model = make_net94()
    norm_biases = [p for k, p in model.named_parameters() if "norm" in k and p.requires_grad]
    other = [p for k, p in model.named_parameters() if "norm" not in k and p.requires_grad]
    opt = torch.optim.SGD(
        [
            dict(params=norm_biases, lr=lr_biases, weight_decay=wd / lr_biases),
            dict(params=other, lr=lr, weight_decay=wd / lr),
        ],
        momentum=o["momentum"],
        nesterov=True,
    )
    top = int(0.23 * total)  # airbench's triangle(total, start=0.2, end=0.07, peak=0.23)
    tri = lambda i: 0.2 + 0.8 * i / max(1, top) if i <= top else 1 - 0.93 * (i - top) / (total - top)  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, tri)
    alpha = 0.95**5 * (torch.arange(total + 1) / total) ** 3
    lookahead = LookaheadState(model)
    init_whitening_conv(model[0], loader.normalize(loader.images[:5000]))
    steps = 0
    for epoch in range(math.ceil(epochs)):
        model[0].bias.requires_grad = epoch < o["whiten_bias_epochs"]
        model.train()
        for inputs, labels in loader:
            loss = loss_fn(model(inputs), labels).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            steps += 1
            if steps % 5 == 0:
                lookahead.update(model, decay=alpha[steps].item())
            if steps >= total:
                lookahead.update(model, decay=1.0)
                break
    return model


def run_airbench(ab, folder: Path, args, seed: int, device: torch.device) -> dict:
    torch.manual_seed(seed)
    loader = airbench_loader(ab, folder, True, args.batch_size, device)
    sync(device)
    t0 = time.perf_counter()
    if device.type == "cuda":
        cwd = os.getcwd()
        os.chdir(folder.parent)  # train94 reads its test set from ./cifar10/test.pt (not scored there)
        try:
            model = ab.train94(train_loader=loader, epochs=args.epochs, verbose=False)
        finally:
            os.chdir(cwd)
    else:
        model = train94_cpu(ab, loader, args.epochs, device)
    sync(device)
    secs = time.perf_counter() - t0
    test = airbench_loader(ab, folder, False, 2000, device)
    acc = ab.evaluate(model, test, tta_level=2)
    return {"side": "airbench train94", "seed": seed, "top1": 100 * acc, "train_s": secs}


# ------------------------------------------------------------------------------------------------ ours
def run_ours(args, seed: int, out: Path, max_steps: int = 0) -> dict:
    from mariana.apps.vision.configs import PRESETS
    from mariana.apps.vision.train import train

    cfg = dataclasses.replace(
        PRESETS["fast"],
        preset="fast",
        data=str(args.data),
        eval_data=str(args.eval_data),
        limit=args.limit,
        eval_limit=args.eval_limit,
        epochs=args.epochs,
        max_steps=max_steps,
        batch_size=args.batch_size,
        lr=PRESETS["fast"].lr * args.batch_size / 1024,
        seed=seed,
        device=args.device,
        amp="off" if args.device == "cpu" else "auto",
        compile=args.compile,
        out=str(out),
        progress=False,
        log_every=10_000,
    )
    cfg.validate()
    final = train(cfg)
    return {"side": "mariana fast", "seed": seed, "top1": final["eval_top1"], "train_s": final["wall_time_s"]}


# ------------------------------------------------------------------------------------------------ report
def summarise(rows: list[dict], epochs: int) -> dict:
    by = {s: [r for r in rows if r["side"] == s] for s in ("airbench train94", "mariana fast")}
    acc = {s: [r["top1"] for r in v] for s, v in by.items()}
    secs = {s: [r["train_s"] for r in v] for s, v in by.items()}
    sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0  # noqa: E731
    a, o = acc["airbench train94"], acc["mariana fast"]
    diff = statistics.mean(o) - statistics.mean(a)
    se = math.sqrt(sd(a) ** 2 / len(a) + sd(o) ** 2 / len(o))
    ratio = statistics.mean(secs["mariana fast"]) / statistics.mean(secs["airbench train94"])
    return {
        "airbench_top1_mean": statistics.mean(a),
        "airbench_top1_std": sd(a),
        "ours_top1_mean": statistics.mean(o),
        "ours_top1_std": sd(o),
        "top1_diff": diff,
        "top1_diff_se": se,
        "airbench_s_per_epoch": statistics.mean(secs["airbench train94"]) / epochs,
        "ours_s_per_epoch": statistics.mean(secs["mariana fast"]) / epochs,
        "time_ratio": ratio,
    }


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=None, help="default: 1 on cpu, 10 on cuda")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--limit", type=int, default=0, help="class-balanced subset of the training images")
    p.add_argument("--eval-limit", type=int, default=0, help="evaluate on the first N of test-dev's order")
    p.add_argument("--data", type=Path, default=DATA / "train.tar")
    p.add_argument("--eval-data", type=Path, default=DATA / "test-dev.tar")
    p.add_argument("--compile", action="store_true", help="torch.compile ours (after one untimed warm-up)")
    p.add_argument("--json", type=Path, default=None, help="write the JSON here instead of bench/results")
    args = p.parse_args(argv)
    if args.epochs is None:
        args.epochs = 1 if args.device == "cpu" else 10
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    ab = need_airbench()
    from importlib.metadata import version

    from mariana.apps.vision.data import decode_all, open_source

    device = torch.device(args.device)
    dec = args.device  # nvJPEG on a GPU
    train = decode_all(open_source(args.data), 32, dec, limit=args.limit)
    test = decode_all(open_source(args.eval_data, train.classes), 32, dec, limit=args.eval_limit)
    rows = []
    with tempfile.TemporaryDirectory(prefix="vision_airbench_") as tmp:
        folder = Path(tmp) / "cifar10"
        folder.mkdir()
        write_airbench_data(folder, train, test)
        if device.type == "cuda":  # untimed warm-ups: cuDNN autotuning (both), compile (ours)
            run_airbench(ab, folder, argparse.Namespace(**{**vars(args), "epochs": 1}), 0, device)
            run_ours(args, 0, Path(tmp) / "warmup", max_steps=20)
        for seed in range(args.seeds):
            for side in ("airbench", "ours"):
                if side == "airbench":
                    r = run_airbench(ab, folder, args, seed, device)
                else:
                    r = run_ours(args, seed, Path(tmp) / f"ours-{seed}")
                rows.append(r)
                print(
                    f"  {r['side']:>16} seed {seed}: top-1 {r['top1']:.2f} %  {r['train_s']:.2f} s",
                    flush=True,
                )
            if seed + 1 < args.seeds:  # rounds so far, in case a time limit stops the rest
                report(args, rows, len(train), len(test), version("airbench"), final=False)
    report(args, rows, len(train), len(test), version("airbench"), final=True)


def report(args, rows: list[dict], n_train: int, n_test: int, ab_version: str, final: bool) -> None:
    """Print (when ``final``) the table and summary line, and write the JSON (``complete``: all rounds)."""
    device = torch.device(args.device)
    s = summarise(rows, args.epochs)
    cpu = device.type == "cpu"
    targets = {
        "top1_diff_min": -0.3 - 2 * s["top1_diff_se"] if cpu else -0.3,
        "time_ratio_max": 1.2 if cpu else 1.3,
    }
    s["meets_targets"] = (
        s["top1_diff"] >= targets["top1_diff_min"] and s["time_ratio"] <= targets["time_ratio_max"]
    )
    shown = [
        {"side": r["side"], "seed": r["seed"], "top1 %": f"{r['top1']:.2f}", "train s": f"{r['train_s']:.2f}"}
        for r in rows
    ]
    line = (
        f"airbench {s['airbench_top1_mean']:.2f} +- {s['airbench_top1_std']:.2f} %, ours {s['ours_top1_mean']:.2f} "
        f"+- {s['ours_top1_std']:.2f} %: difference {s['top1_diff']:+.2f} (SE {s['top1_diff_se']:.2f}, target >= "
        f"{targets['top1_diff_min']:.2f}); s/epoch ours {s['ours_s_per_epoch']:.2f} vs {s['airbench_s_per_epoch']:.2f} "
        f"= {s['time_ratio']:.3f}x (target <= {targets['time_ratio_max']}); compile excluded for both; "
        f"airbench's make_net94 and CifarLoader unchanged except device ({args.device}) and dtype "
        f"({'fp32' if cpu else 'fp16 as packaged'}); ours {'fp32' if cpu else 'bf16 autocast'}"
    )
    if final:
        print(table(shown, ["side", "seed", "top1 %", "train s"]))
        print(line)
    payload = {
        "command": "bench/vision_airbench.py " + " ".join(sys.argv[1:]),
        "commit": git_commit(),
        "airbench_version": ab_version,
        "complete": final,
        "device": args.device,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "train_images": n_train,
        "eval_images": n_test,
        "notes": "seeds interleaved; training seconds exclude compile and evaluation for both; airbench's "
        "make_net94 and CifarLoader unchanged except device and dtype"
        + (
            "; CPU: train94's loop re-run step for step (airbench.utils.train needs CUDA events)"
            if cpu
            else ""
        ),
        "rows": rows,
        "summary": s,
        "targets": targets,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
        path = args.json
    else:
        path = write_result("vision_airbench", payload)
    if final:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
