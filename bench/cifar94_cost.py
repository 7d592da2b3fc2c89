"""What the published 94 % CIFAR-10 recipe costs on this CPU: the airbench94 network's training step timed
here, and the wall time of its schedule projected from it.

The network (Keller Jordan's airbench94, the fastest published recipe to 94 %): a 2x2 patch-whitening
convolution to 24 channels, then three blocks of conv3x3 -> max-pool 2 -> BatchNorm -> GELU -> conv3x3 ->
BatchNorm -> GELU with widths 64, 256, 256, a 3x3 max-pool and a linear head; batch 1024, about 10 epochs of
the 50,000 training images, then flip test-time augmentation (twice the 10,000 test images' forward passes).
Its multiply-adds per image are counted from the layer shapes; the GFLOP/s column counts a training image as
three forward passes' worth (forward, and backward for inputs and weights), 2 FLOPs per multiply-add. The step (forward, backward, SGD with
Nesterov momentum) is timed on random 32x32 inputs in fp32 and in bf16 autocast, channels-last, on all cores;
no decoding or augmentation is counted, so the projection is a lower bound on the recipe's wall time.

Usage: ``python bench/cifar94_cost.py [--batch 1024] [--steps 5]`` (about 2 minutes on 2 cores; writes
bench/results/cifar94_cost-cpu.json).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_result  # noqa: E402

WIDTHS = (64, 256, 256)
EPOCHS, TRAIN, TEST = 10, 50_000, 10_000


def airbench94() -> nn.Sequential:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.MaxPool2d(2),
            nn.BatchNorm2d(cout),
            nn.GELU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.GELU(),
        ]

    a, b, c = WIDTHS
    return nn.Sequential(
        nn.Conv2d(3, 24, 2, bias=True),  # whitening patches: 32 -> 31 px
        nn.GELU(),
        *block(24, a),
        *block(a, b),
        *block(b, c),
        nn.MaxPool2d(3),
        nn.Flatten(),
        nn.Linear(c, 10, bias=False),
    )


def macs_per_image(model: nn.Sequential) -> int:
    """Multiply-adds of one 32x32 image's forward pass (convolutions and the linear head)."""
    total, hooks = 0, []

    def conv(m, inp, out):
        nonlocal total
        total += out[0].numel() * m.in_channels * m.kernel_size[0] * m.kernel_size[1] // m.groups

    def lin(m, inp, out):
        nonlocal total
        total += m.in_features * m.out_features

    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            hooks.append(m.register_forward_hook(conv))
        elif isinstance(m, nn.Linear):
            hooks.append(m.register_forward_hook(lin))
    with torch.no_grad():
        model.eval()(torch.zeros(1, 3, 32, 32))
    for h in hooks:
        h.remove()
    return total


def time_step(batch: int, steps: int, bf16: bool) -> float:
    """Seconds per training step (forward, backward, SGD-Nesterov) at ``batch``, after 2 untimed steps."""
    torch.manual_seed(0)
    model = airbench94().to(memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.85, nesterov=True, weight_decay=5e-4)
    x = torch.randn(batch, 3, 32, 32).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,))
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    for i in range(steps + 2):
        if i == 2:
            t0 = time.perf_counter()
        with ctx():
            loss = nn.functional.cross_entropy(model(x).float(), y, label_smoothing=0.2)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1024, help="training batch (airbench94's)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per precision")
    args = ap.parse_args(argv)
    macs = macs_per_image(airbench94())
    rows, res = [], {}
    for name, bf16 in (("fp32", False), ("bf16 autocast", True)):
        step = time_step(args.batch, args.steps, bf16)
        img_s = args.batch / step
        # training images, plus the test set's forward passes twice (flip TTA) at a third of a step's cost
        wall = EPOCHS * TRAIN / img_s + 2 * TEST / (3 * img_s)
        res[name] = {"step_s": step, "train_img_per_s": img_s, "projected_wall_s": wall,
                     "achieved_gflops": 3 * 2 * macs * img_s / 1e9}  # fmt: skip
        rows.append({"precision": name, "step s": f"{step:.2f}", "train img/s": f"{img_s:.0f}",
                     "GFLOP/s": f"{res[name]['achieved_gflops']:.0f}",
                     "10 epochs + TTA eval": f"{wall / 60:.1f} min"})  # fmt: skip
    print(f"airbench94 network: {macs / 1e6:.1f} M multiply-adds per image forward, batch {args.batch}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(table(rows, ["precision", "step s", "train img/s", "GFLOP/s", "10 epochs + TTA eval"]))
    path = write_result(
        "cifar94_cost",
        {"benchmark": "cifar94_cost", "setup": vars(args), "macs_per_image": macs, "epochs": EPOCHS,
         "results": res},
    )  # fmt: skip
    print(f"results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
