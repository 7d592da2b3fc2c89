"""Cut an ``nn.Sequential`` of blocks into K contiguous stages that keep the blocks' names (so stage state
dicts merge back by a plain union), balanced by ``"params"`` (memory), ``"time"`` (throughput) or explicit
boundaries ``[b1, ..., b_{K-1}]`` (the block indices where stages 1..K-1 start); README.md: How a model is split.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch
from mariana.platform.core.errors import MarianaError
from torch import nn


def block_costs_params(blocks: nn.Sequential) -> list[float]:
    return [float(sum(p.numel() for p in b.parameters())) for b in blocks]


def block_costs_time(blocks: nn.Sequential, sample: torch.Tensor, repeats: int = 2) -> list[float]:
    """Seconds of forward+backward per block on ``sample`` (the input of block 0), measured in order."""
    costs = [0.0] * len(blocks)
    was_training = blocks.training
    blocks.train()
    for _ in range(repeats):
        x = sample
        for i, b in enumerate(blocks):
            x = x.detach().requires_grad_(x.is_floating_point())
            t = time.perf_counter()
            y = b(x)
            y.float().sum().backward()
            if y.is_cuda:
                torch.cuda.synchronize()
            costs[i] += time.perf_counter() - t
            x = y
    blocks.zero_grad(set_to_none=True)
    blocks.train(was_training)
    return costs


def balanced_boundaries(costs: Sequence[float], k: int) -> list[int]:
    """Block indices where stages 1..k-1 start, minimising the largest stage's cost (exact DP; every
    stage gets at least one block). ``len(costs)`` >= k."""
    n = len(costs)
    if k < 1 or n < k:
        raise MarianaError(f"cannot cut {n} block(s) into {k} pipeline stages (each stage needs >= 1 block)")
    prefix = [0.0, *itertools.accumulate(costs)]
    inf = float("inf")
    # best[j][i]: minimal max-stage cost for blocks[:i] in j stages; arg[j][i]: start of the last stage
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    arg = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for s in range(j - 1, i):
                v = max(best[j - 1][s], prefix[i] - prefix[s])
                # ties: prefer the later cut (keeps early, activation-heavy layers together)
                if v < best[j][i] or (v == best[j][i] and s > arg[j][i]):
                    best[j][i], arg[j][i] = v, s
    cuts, i = [], n
    for j in range(k, 0, -1):
        s = arg[j][i]
        cuts.append(s)
        i = s
    return sorted(cuts)[1:]  # drop the 0 start of stage 0


def split_blocks(
    blocks: nn.Sequential, k: int, balance: str | Sequence[int] = "params", sample: torch.Tensor | None = None
) -> list[nn.Sequential]:
    """``blocks`` -> K stage Sequentials (sharing the block modules, names kept). See module docstring."""
    if not isinstance(blocks, nn.Sequential):
        raise MarianaError(
            f"pipeline stages need the model as an nn.Sequential of blocks, got {type(blocks).__name__}"
        )
    n = len(blocks)
    if isinstance(balance, str):
        if balance == "params":
            costs = block_costs_params(blocks)
        elif balance == "time":
            if sample is None:
                raise MarianaError("balance='time' needs a sample input batch")
            costs = block_costs_time(blocks, sample)
        else:
            raise MarianaError(
                f"unknown stage balance {balance!r}: use params, time or a list of block indices"
            )
        bounds = balanced_boundaries(costs, k)
    else:
        bounds = sorted(int(b) for b in balance)
        if (
            len(bounds) != k - 1
            or (bounds and (bounds[0] < 1 or bounds[-1] >= n))
            or len(set(bounds)) != len(bounds)
        ):
            raise MarianaError(
                f"stage boundaries {list(balance)} must be {k - 1} distinct block indices in 1..{n - 1}"
            )
    starts = [0, *bounds, n]
    names = list(blocks._modules.keys())
    return [
        nn.Sequential(OrderedDict((names[i], blocks[i]) for i in range(starts[s], starts[s + 1])))
        for s in range(k)
    ]


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def param_bytes(module: nn.Module) -> int:
    return tensor_bytes(module.parameters())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state tensors (momentum, Adam moments, ...)."""
    return sum(
        tensor_bytes(v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        for st in optimizer.state.values()
    )
