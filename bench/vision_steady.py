"""Vision steady-state training rate: the platform's data-parallel path vs a plain PyTorch loop, interleaved.

Ours: what `mariana vision train` runs for a standard-recipe preset (``gpu94`` on a GPU) with the decoded
set on the device: `CachedLoader` (the sampler's indices -> gather on the device) -> `ModuleStep`
(autocast bf16 on a GPU, the preset's optimizer from `build_optimizer`, LR schedule, clipping if set) over
the step training uses (augment + normalise on the device, ``torch.compile`` when the preset compiles,
cross-entropy with the preset's label smoothing), the loss summed on the device and read once per round.
Plain: a fresh model of the same architecture and memory format, compiled alike, the same decoded images
indexed by a device permutation, the same augmentation and normalisation, the same loss, the same
optimizer (`build_optimizer`, fused where PyTorch has it), no schedule. Same batch, same precision.

Each round times ``steps`` steps of each side (which goes first alternates); the ratio is the median of the
per-round ratios (ours images/s / plain images/s), after ``warmup`` untimed steps of each (compile, cudnn
autotuning). Used by `bench/vision_throughput.py --steady PRESET`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F
from mariana.apps.vision.configs import PRESETS, VisionConfig
from mariana.apps.vision.data import DecodedImages, decode_all, make_prepare, open_source
from mariana.apps.vision.loaders import CachedLoader, decode_device
from mariana.apps.vision.model import build_model
from mariana.platform.core.optim import build_optimizer
from mariana.platform.core.steps import ModuleStep, autocast_for
from mariana.platform.dp.sampler import ShardedBatchSampler
from mariana.platform.runtime.dist import DistContext


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def steady_config(preset: str, device: torch.device, batch: int, compile_: bool | None) -> VisionConfig:
    """The preset as training resolves it on ``device`` (``batch`` > 0 / ``compile_`` not None override)."""
    cfg = PRESETS[preset]
    if cfg.recipe != "standard" or cfg.augment == "alt-flip-translate":
        raise SystemExit(
            f"--steady {preset}: only standard-recipe presets (e.g. gpu94, small) are timed here"
        )
    over: dict = {"device": device.type, "progress": False}
    if batch:
        over["batch_size"] = batch
    if compile_ is not None:
        over["compile"] = compile_
    return dataclasses.replace(cfg, **over)


def _model(cfg: VisionConfig, device: torch.device, classes: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the plain module, what the step calls: compiled when the preset compiles), as `_train` builds it."""
    model = build_model(cfg.model, classes, cfg.image_size, cfg.dropout).to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, torch.compile(model) if cfg.compile else model


class Ours:
    """The platform's path: `CachedLoader` over the decoded set and `ModuleStep` over training's step."""

    def __init__(self, cfg: VisionConfig, data: DecodedImages, device: torch.device, classes: int):
        self.device = device
        _, fwd = _model(cfg, device, classes)
        prepare = make_prepare(cfg.net, train=True)

        def step_fn(m, batch):  # `_train_data_parallel`'s step for a decoded set
            x, y = batch
            return F.cross_entropy(m(prepare(x)).float(), y, label_smoothing=cfg.label_smoothing), len(y)

        self.step = ModuleStep(cfg, fwd, step_fn, DistContext(device=device))
        self.step.setup(10**6)
        self.loader = CachedLoader(data, ShardedBatchSampler(len(data), cfg.batch_size, 0, 1, cfg.seed))
        self.epoch, self.batches = 0, iter(())

    def _next(self):
        for _ in range(2):
            for b in self.batches:
                return b
            self.batches, self.epoch = self.loader.iterate(self.epoch), self.epoch + 1
        raise RuntimeError("the decoded set holds less than one batch")

    def run(self, steps: int) -> tuple[float, int]:
        """-> (seconds, images) of ``steps`` steps; the loss is read once at the end (the log step's read)."""
        sync(self.device)
        t0 = time.perf_counter()
        loss_sum, n = torch.zeros((), device=self.device), 0
        for _ in range(steps):
            loss, k = self.step.train_step([self._next()])
            loss_sum += loss
            n += k
        float(loss_sum)
        return time.perf_counter() - t0, n


class Plain:
    """The plain loop over the same decoded images (see the module docstring)."""

    def __init__(self, cfg: VisionConfig, data: DecodedImages, device: torch.device, classes: int):
        self.cfg, self.device, self.data = cfg, device, data
        self.model, self.fwd = _model(cfg, device, classes)
        self.opt = build_optimizer(cfg, self.model.parameters())
        self.prepare = make_prepare(cfg.net, train=True)
        self.perm = torch.randperm(len(data), device=device)
        self.pos = 0

    def run(self, steps: int) -> tuple[float, int]:
        cfg, b = self.cfg, self.cfg.batch_size
        sync(self.device)
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(steps):
            if self.pos + b > len(self.perm):
                self.pos = 0
            idx = self.perm[self.pos : self.pos + b]
            self.pos += b
            x, y = self.prepare(self.data.images[idx]), self.data.labels[idx]
            with autocast_for(cfg, self.device):
                logits = self.fwd(x)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=cfg.label_smoothing)
            loss.backward()
            if cfg.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
        float(loss_sum)
        return time.perf_counter() - t0, steps * b


def steady_case(tar: str, preset: str, device: torch.device, steps: int, rounds: int, **kw) -> dict:
    """Decode ``tar`` once onto ``device`` (``limit`` images, 0: all), warm both sides up (``warmup``
    steps), then ``rounds`` interleaved rounds of ``steps`` steps -> the result row (img/s, ratio, rounds).
    ``kw``: batch (0: the preset's), limit, warmup, compile_ (None: the preset's)."""
    cfg = steady_config(preset, device, kw.get("batch", 0), kw.get("compile_"))
    if device.type == "cuda":  # as `_train` sets them
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    t0 = time.perf_counter()
    src = open_source(tar)
    data = decode_all(src, cfg.image_size, decode_device(cfg.decode, device), kw.get("limit", 0))
    data.images, data.labels = data.images.to(device), data.labels.to(device)
    decode_s = time.perf_counter() - t0
    ours, plain = Ours(cfg, data, device, len(src.classes)), Plain(cfg, data, device, len(src.classes))
    t0 = time.perf_counter()
    ours.run(kw.get("warmup", 3))
    plain.run(kw.get("warmup", 3))
    warm_s = time.perf_counter() - t0
    per = []
    for r in range(rounds):
        sides = [("ours", ours), ("plain", plain)][:: -1 if r % 2 else 1]
        t = {name: side.run(steps) for name, side in sides}
        assert t["ours"][1] == t["plain"][1]
        per.append({"ours_s": t["ours"][0], "plain_s": t["plain"][0], "images": t["ours"][1]})
        per[-1]["ratio"] = per[-1]["plain_s"] / per[-1]["ours_s"]
        print(f"steady round {r + 1}: " + " ".join(f"{k} {v:.3f}" for k, v in per[-1].items()), flush=True)
    mid = sorted(per, key=lambda r: r["ratio"])[(rounds - 1) // 2]
    return {
        "path": "steady",
        "preset": preset,
        "model": cfg.model,
        "image_size": cfg.image_size,
        "batch": cfg.batch_size,
        "optimizer": cfg.optimizer,
        "bf16": device.type == "cuda" and cfg.amp in ("auto", "bf16"),
        "compile": cfg.compile,
        "channels_last": cfg.channels_last,
        "images_decoded": len(data),
        "decode_s": decode_s,
        "warmup_steps": kw.get("warmup", 3),
        "warmup_s": warm_s,
        "steps": steps,
        "rounds": per,
        "ours_img_s": mid["images"] / mid["ours_s"],
        "plain_img_s": mid["images"] / mid["plain_s"],
        "ratio": statistics.median(r["ratio"] for r in per),
    }
