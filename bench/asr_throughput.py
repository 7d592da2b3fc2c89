"""ASR training throughput: the platform's path as `mariana asr train` runs it vs a plain PyTorch loop, same
run, interleaved rounds.

Ours: the model compiled where training compiles it (`train.compiles`: on a GPU unless ``--compile off``),
the feature cache in the tier training picks (`apps/asr/batches.make_loader`: on the device when it
fits, batches gathered there; else RAM; else disk through one persistent DataLoader with training's
``--num-workers``), built once for the whole bench -> `ModuleStep` (autocast bf16 on a GPU, gradient
clipping, fused AdamW, LR schedule) over the step function training uses (splice on the device, CTC with
host-side lengths), the loss summed on the device and read once per round, as the Trainer does between log
steps. Augmentation is off on both sides (the plain loop has none).
Plain: the same network (a fresh one of the same preset) fed the same batches already spliced and on the
device -> the same CTC loss -> the same clipping -> fused AdamW, eager as a plain loop is written
(``--plain-compile``: compiled too). It does strictly less work. ``--also-eager``: our path uncompiled as a
third side of the same rounds.

Each round times ``--steps`` steps of ours and of plain over the same batches (which goes first alternates); the ratio is the median of
the per-round ratios (ours frames/s / plain frames/s), so machine load hits both sides alike.
``--preset mariana`` is the 50.7M-parameter DNN (bf16 on a GPU) at about ``--frames-per-step`` frames.
``ops_per_step`` in the JSON: aten ops and Python calls per step of both loops (`count_ops`; on CUDA each leaf
aten op is about one kernel launch, and the small recipe is launch-bound there). ``--compile-start`` also times two fresh processes' start-up with ``--compile`` (the second loads the
artifacts the first saved, `platform/core/compilecache.py`). Usage::

    .venv/bin/python bench/asr_throughput.py [--preset small|mariana] [--steps N] [--rounds 5] [--compile-start]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_result  # noqa: E402
from mariana.apps.asr.batches import make_loader  # noqa: E402
from mariana.apps.asr.configs import PRESETS  # noqa: E402
from mariana.apps.asr.data import prepare  # noqa: E402
from mariana.apps.asr.features import cached_features  # noqa: E402
from mariana.apps.asr.model import build_model, splice  # noqa: E402
from mariana.apps.asr.train import (  # noqa: E402
    BLANK,
    BucketBatchSampler,
    UtteranceSet,
    compile_model,
    compiles,
    feature_settings,
    flush_denormals_on_cpu,
    make_step_fn,
)
from mariana.platform.core import compilecache  # noqa: E402
from mariana.platform.core.optim import build_optimizer  # noqa: E402
from mariana.platform.core.steps import ModuleStep, autocast_for  # noqa: E402
from mariana.platform.runtime.dist import DistContext  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def batches_from(loader, n: int):
    """``n`` batches from epoch 0 on (the same ones every call: the sampler's order is seeded)."""
    epoch, got = 0, 0
    while got < n:
        for b in loader.iterate(epoch):
            yield b
            got += 1
            if got == n:
                return
        epoch += 1


class Ours:
    """The platform's path: training's loader (built once) and `ModuleStep` over training's step fn."""

    def __init__(self, cfg, dataset, device, n_units):
        self.cfg, self.device = cfg, device
        sampler = BucketBatchSampler(dataset.lengths, cfg.batch_size, seed=cfg.seed)
        self.loader, self.tier = make_loader(cfg, dataset, sampler, device)
        model = compile_model(build_model(dataclasses.asdict(cfg), n_units).to(device), cfg)
        self.compiled = compiles(cfg, device)  # training's rule: --compile/--no-compile, else on a GPU
        self.step = ModuleStep(cfg, model, make_step_fn(cfg), DistContext(device=device))
        self.step.setup(10**6)
        self.params = sum(p.numel() for p in model.parameters())

    def run(self, steps: int, keep: bool = False):
        """-> (seconds, valid frames, kept batches) of ``steps`` steps; the loss is read once at the end."""
        sync(self.device)
        t0 = time.perf_counter()
        loss_sum, lengths, kept = torch.zeros((), device=self.device), [], []
        for batch in batches_from(self.loader, steps):
            loss, _ = self.step.train_step([batch])
            loss_sum += loss
            lengths.append(batch["sizes"].lengths)  # host tensors, summed once the clock has stopped
            if keep:
                kept.append(batch)
        float(loss_sum)  # the log step's read (syncs the device)
        seconds = time.perf_counter() - t0
        return seconds, sum(int(n.sum()) for n in lengths), kept


class Plain:
    """The plain loop: same network, inputs spliced already and on the device, CTC, clipping, fused AdamW."""

    def __init__(self, cfg, batches, device, n_units, compiled: bool = False):
        self.cfg, self.device = cfg, device
        self.model = build_model(dataclasses.asdict(cfg), n_units).to(device)
        self.fwd = torch.nn.Sequential(self.model.body, self.model.out)
        if compiled:  # --plain-compile: the like-for-like compiled row (a plain loop is eager by default)
            self.fwd = torch.compile(self.fwd, backend=cfg.compile_backend)
        self.opt = build_optimizer(cfg, self.model.parameters())  # fused AdamW, as the platform's
        self.batches = [
            (
                splice(b["feats"], cfg.context, b["lengths"]).contiguous(),
                b["targets"],
                b["sizes"].lengths,
                b["sizes"].target_lengths,
            )
            for b in batches
        ]
        self.frames = sum(int(lens.sum()) for _, _, lens, _ in self.batches)

    def run(self):
        sync(self.device)
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        for x, tg, lens, tl in self.batches:
            with autocast_for(self.cfg, self.device):
                logp = torch.log_softmax(self.fwd(x).float(), dim=-1)
            loss = torch.nn.functional.ctc_loss(
                logp.transpose(0, 1), tg, lens, tl, blank=0, reduction="mean", zero_infinity=True
            )
            loss.backward()
            if self.cfg.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
        float(loss_sum)
        return time.perf_counter() - t0, self.frames


def timed_rounds(ours: Ours, plain: Plain, eager: Ours | None, steps: int, n: int) -> list[dict]:
    """``n`` interleaved rounds (the order of the sides reverses every other round, so none always follows
    another) -> per round: seconds of each side over the same ``steps`` batches, frames, plain_s / ours_s
    (``ratio``) and, with ``eager`` (our path uncompiled), plain_s / eager_s (``eager_ratio``)."""
    sides = {"ours": lambda: ours.run(steps)[:2], "plain": plain.run}
    if eager is not None:
        sides["eager"] = lambda: eager.run(steps)[:2]
    rounds = []
    for r in range(n):
        t, frames = {}, set()
        for name in list(sides)[:: -1 if r % 2 else 1]:
            t[f"{name}_s"], f = sides[name]()
            frames.add(f)
        assert len(frames) == 1, frames  # every side trained on the same frames
        t |= {"ratio": t["plain_s"] / t["ours_s"], "frames": frames.pop()}
        if eager is not None:
            t["eager_ratio"] = t["plain_s"] / t["eager_s"]
        rounds.append(t)
        print(
            f"round {r + 1}: " + " ".join(f"{k} {v:.3f}" for k, v in t.items() if k != "frames"), flush=True
        )
    return rounds


def count_ops(run, steps: int) -> dict:
    """``run()`` (``steps`` training steps) profiled on the host side -> per step: "leaf" aten ops (ops that
    call no other aten op: about one kernel launch each on CUDA), "all" aten ops, and "py_calls" (Python
    and builtin function calls, a deterministic measure of the step's Python overhead)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    leaf = total = 0
    for e in prof.events():
        if e.name.startswith("aten::"):
            total += 1
            leaf += not any(c.name.startswith("aten::") for c in e.cpu_children)
    calls = [0]

    def tick(frame, event, arg):
        calls[0] += event in ("call", "c_call")

    sys.setprofile(tick)
    try:
        run()
    finally:
        sys.setprofile(None)
    return {"leaf": leaf / steps, "all": total / steps, "py_calls": calls[0] / steps}


def ops_per_step(ours: Ours, plain: Plain, steps: int) -> dict:
    """`count_ops` of both loops (both already warm), ours over the same ``steps`` batches as plain."""
    return {"ours": count_ops(lambda: ours.run(steps), steps), "plain": count_ops(plain.run, steps)}


class _TorchCtcUnchecked(torch.autograd.Function):
    """torch's CTC loss with the sync check off inside it, forward and backward: its CUDA kernels copy their
    length tables to the device synchronously (``at::tensor(lengths)``, ``tg_batch_offsets.cuda()`` in
    LossCTC.cu), one sync per call whatever the caller does; the plain loop pays the same."""

    @staticmethod
    def forward(ctx, logp, targets, lengths, target_lengths, kw):
        with torch.enable_grad():
            lp = logp.detach().requires_grad_()
            torch.cuda.set_sync_debug_mode(0)
            try:
                loss = _TORCH_CTC(lp, targets, lengths, target_lengths, **kw)
            finally:
                torch.cuda.set_sync_debug_mode("error")
        ctx.lp, ctx.loss = lp, loss
        return loss.detach()

    @staticmethod
    def backward(ctx, grad):
        torch.cuda.set_sync_debug_mode(0)
        try:
            (g,) = torch.autograd.grad(ctx.loss, ctx.lp, grad)
        finally:
            torch.cuda.set_sync_debug_mode("error")
        return g, None, None, None, None


_TORCH_CTC = torch.nn.functional.ctc_loss


def sync_check(ours: Ours, steps: int = 3) -> str:
    """Run ``steps`` of ours (after a pass over the same batches) under ``torch.cuda.set_sync_debug_mode("error")`` (torch's own CTC kernels
    exempted, `_TorchCtcUnchecked`): "passed", or the error (the op that synchronised and where)."""
    import traceback

    batches = list(batches_from(ours.loader, steps + 1))
    for b in batches:  # lazy state and, when compiled, every graph first (compiling is not the step)
        ours.step.train_step([b])
    torch.cuda.synchronize()

    def ctc(logp, targets, lengths, target_lengths, **kw):
        return _TorchCtcUnchecked.apply(logp, targets, lengths, target_lengths, kw)

    torch.nn.functional.ctc_loss = ctc
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in batches[1:]:
            ours.step.train_step([b])
        return "passed"
    except RuntimeError as e:
        where = [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)[-4:]]
        return f"{str(e).splitlines()[0]} at {' <- '.join(reversed(where))}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.nn.functional.ctc_loss = _TORCH_CTC


def prepared(args, tmp: str) -> Path:
    if args.data:
        return Path(args.data)
    data = Path(tmp) / "asr"
    prepare(ROOT.parent / "shared/data/fsdd/recordings", data, ["yweweler"], utterances=40, max_digits=5)
    return data


def bench_config(args, device, lengths):
    cfg = PRESETS[args.preset]
    # no augmentation on either side; training's loader settings (tier rule, workers) otherwise
    compile_ = {"auto": None, "on": True, "off": False}[args.compile]
    over = dict(spec_augment=False, time_stretch=[1.0, 1.0], compile=compile_, device=device.type)
    over |= dict(num_workers=args.num_workers, cache_gb=args.cache_gb)
    if args.batch_size:
        over["batch_size"] = args.batch_size
    elif args.frames_per_step:
        over["batch_size"] = max(1, round(args.frames_per_step / statistics.mean(lengths)))
    return dataclasses.replace(cfg, **over)


def start_probe(args) -> None:
    """One fresh process: compile, load saved artifacts, 3 steps, save; prints its start-up seconds."""
    t0 = time.perf_counter()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        cache = cached_features(prepared(args, tmp) / "train", feature_settings(PRESETS[args.preset]), 2)
        vocab = [BLANK] + sorted({w for u in cache.utts for w in u["words"]})
        ds = UtteranceSet(cache, vocab)
        args.compile = "on"
        cfg = bench_config(args, device, ds.lengths)
        path = compilecache.cache_path(f"asr-bench|{args.preset}|{cfg.batch_size}", device)
        loaded = compilecache.load(path)
        ours = Ours(cfg, ds, device, len(vocab))
        t1 = time.perf_counter()
        ours.run(3)
        t2 = time.perf_counter()
        compilecache.save(path)
    from torch._dynamo.utils import counters

    hits = {k: v for k, v in counters["inductor"].items() if "cache" in k}  # fxgraph_cache_hit, ...
    print(json.dumps({"first_steps_s": t2 - t1, "process_s": t2 - t0, "loaded": loaded, "caches": hits}))


def compile_starts(args) -> dict:
    """Two fresh processes with --compile: the first compiles (empty caches), the second loads the
    artifacts the first saved (inductor's and Triton's own cache dirs are new for each, so only ours
    carries over; ``caches`` shows inductor's cache hits)."""
    out = {}
    with tempfile.TemporaryDirectory() as cc:
        for name in ("first", "second"):
            fresh = {k: str(Path(cc) / name / k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
            env = dict(os.environ, MARIANA_COMPILE_CACHE=cc, **fresh)
            cmd = [
                sys.executable,
                __file__,
                "--start-probe",
                "--preset",
                args.preset,
                "--device",
                args.device,
            ]
            cmd += ["--frames-per-step", str(args.frames_per_step), "--batch-size", str(args.batch_size)]
            cmd += ["--data", args.data] if args.data else []
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            out[name] = json.loads(p.stdout.strip().splitlines()[-1])
            print(f"compile start {name}: {out[name]}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", default="", help="prepared ASR folder (default: a small one from ../shared/data)"
    )
    p.add_argument("--preset", default="small", help="model preset (small: the default recipe's network)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=0, help="utterances per step (0: the preset's)")
    p.add_argument("--frames-per-step", type=int, default=0, help="batch by mean frames (mariana: 8192)")
    p.add_argument("--steps", type=int, default=0, help="timed steps per round (0: 10 on CPU, 40 on GPU)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (ratio: median over rounds)")
    p.add_argument("--num-workers", type=int, default=0, help="loader workers (training's default: 0)")
    p.add_argument("--cache-gb", type=float, default=4.0, help="training's --cache-gb (tier rule)")
    p.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "on", "off"],
        help="torch.compile our model (auto: as training does, on a GPU only)",
    )
    p.add_argument("--plain-compile", action="store_true", help="torch.compile the plain loop's model too")
    p.add_argument("--also-eager", action="store_true", help="when ours compiles, also time it uncompiled")
    p.add_argument("--compile-start", action="store_true", help="also time two fresh compiled starts")
    p.add_argument("--start-probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--name", default="asr_throughput", help="result file name under bench/results")
    p.add_argument("--json", default="", help="also write the result JSON here")
    args = p.parse_args()
    if args.preset == "mariana" and not args.batch_size and not args.frames_per_step:
        args.frames_per_step = 8192
    if args.start_probe:
        return start_probe(args)
    device = torch.device(args.device)
    flush_denormals_on_cpu(device)  # as `mariana asr train` does on the CPU; the plain loop gets it too
    steps = args.steps or (40 if device.type == "cuda" else 10)
    with tempfile.TemporaryDirectory() as tmp:
        cache = cached_features(prepared(args, tmp) / "train", feature_settings(PRESETS[args.preset]), 2)
        vocab = [BLANK] + sorted({w for u in cache.utts for w in u["words"]})
        ds = UtteranceSet(cache, vocab)
        cfg = bench_config(args, device, ds.lengths)
        ours = Ours(cfg, ds, device, len(vocab))
        t0 = time.perf_counter()
        _, _, kept = ours.run(steps, keep=True)  # warm-up: compiles, allocates, keeps the batches
        warm_s = time.perf_counter() - t0
        plain = Plain(cfg, kept, device, len(vocab), args.plain_compile)
        plain.run()  # its warm-up
        eager = None
        if args.also_eager and ours.compiled:  # the same path with --no-compile, in the same rounds
            eager = Ours(dataclasses.replace(cfg, compile=False), ds, device, len(vocab))
            eager.run(steps)
        rounds = timed_rounds(ours, plain, eager, steps, args.rounds)
        ops = ops_per_step(ours, plain, steps)
        print(f"aten ops per step: {ops}", flush=True)
        synced = sync_check(ours) if device.type == "cuda" else "not run (CPU)"
        print(f"sync check: {synced}", flush=True)
    starts = compile_starts(args) if args.compile_start else None
    ratio = statistics.median(r["ratio"] for r in rounds)
    mid = sorted(rounds, key=lambda r: r["ratio"])[(len(rounds) - 1) // 2]
    rows = [
        {"loop": f"ours ({ours.tier} tier)", "frames/s": f"{mid['frames'] / mid['ours_s']:.0f}"},
        {"loop": "plain, fused AdamW", "frames/s": f"{mid['frames'] / mid['plain_s']:.0f}"},
    ]
    if "eager_s" in mid:
        rows.append({"loop": "ours, --no-compile", "frames/s": f"{mid['frames'] / mid['eager_s']:.0f}"})
    rows[0]["loop"] += ", compiled" if ours.compiled else ""
    for r in rows:
        r |= {"frames/step": round(mid["frames"] / steps), "params M": f"{ours.params / 1e6:.1f}"}
    print(table(rows, ["loop", "frames/s", "frames/step", "params M"]))
    result = {
        "command": "bench/asr_throughput.py " + " ".join(sys.argv[1:]),
        "preset": args.preset,
        "device": str(device),
        "bf16": device.type == "cuda" and cfg.amp in ("auto", "bf16"),
        "compile": ours.compiled,
        "plain_compile": args.plain_compile,
        "tier": ours.tier,
        "num_workers": cfg.num_workers,
        "batch_utterances": cfg.batch_size,
        "frames_per_step": mid["frames"] / steps,
        "params": ours.params,
        "steps": steps,
        "warmup_s": warm_s,
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "ours_frames_per_s": mid["frames"] / mid["ours_s"],
        "plain_frames_per_s": mid["frames"] / mid["plain_s"],
        "ratio_vs_plain_fused": ratio,
        "eager_ratio_vs_plain_fused": statistics.median(r["eager_ratio"] for r in rounds) if eager else None,
        "compile_start_s": starts,
        "ops_per_step": ops,
        "sync_debug_error_mode": synced,
    }
    path = write_result(args.name, result)
    if args.json:
        Path(args.json).write_text(Path(path).read_text())
    print(f"wrote {path}")
    print(
        f"ours / plain (same CTC loss, fused AdamW, same batches): {ratio:.3f}x (median of per-round ratios)"
    )


if __name__ == "__main__":
    main()
