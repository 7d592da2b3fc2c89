"""Per-step overhead of the ASR training path vs the plain loop: aten ops per step and host seconds per step.

On a GPU the default `small` recipe is launch-bound (1.24M parameters, ~1,600 frames per step): every aten
op is a kernel launch and every microsecond of Python shows. This proxy measures both on any device:

- ``ops_per_step``: leaf aten ops per training step (forward, backward, optimizer, batch assembly), counted
  with `torch.profiler` over a few steps (`asr_throughput.count_ops`; on CUDA each is about one kernel
  launch), and Python function calls per step (``py_calls``, counted with `sys.setprofile`);
- ``host_us_per_step``: CPU microseconds per step of a tiny network and batch (``--hidden 8``, ``--context 1``,
  one utterance per step), where
  the arithmetic is negligible and what is left is dispatch and Python (ours vs plain, interleaved rounds,
  medians; noisy on a loaded machine, the counts are not). The counts are of the preset's own network.

Usage::

    .venv/bin/python bench/asr_step_overhead.py [--device cpu] [--steps 20] [--rounds 5] [--hidden 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from asr_throughput import Ours, Plain, bench_config, ops_per_step, prepared  # noqa: E402
from common import write_result  # noqa: E402
from mariana.apps.asr.configs import PRESETS  # noqa: E402
from mariana.apps.asr.features import cached_features  # noqa: E402
from mariana.apps.asr.train import BLANK, UtteranceSet, feature_settings  # noqa: E402


def pair(cfg, ds, device, n_units: int, steps: int) -> tuple[Ours, Plain]:
    """Ours and the plain loop over the same ``steps`` batches, both warmed up."""
    ours = Ours(cfg, ds, device, n_units)
    _, _, kept = ours.run(steps, keep=True)
    plain = Plain(cfg, kept, device, n_units)
    plain.run()
    return ours, plain


def measure(cfg, ds, device, n_units: int, steps: int) -> dict:
    """{"ours": {"leaf", "all"}, "plain": ...}: aten ops per step of both loops at ``cfg``."""
    return ops_per_step(*pair(cfg, ds, device, n_units, steps), steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="")
    p.add_argument("--preset", default="small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hidden", type=int, default=8, help="network width for the host-time proxy")
    p.add_argument("--context", type=int, default=1, help="splice context for the host-time proxy")
    p.add_argument("--name", default="asr_step_overhead", help="result file name under bench/results")
    a = p.parse_args()
    a.batch_size = a.frames_per_step = a.num_workers = 0
    a.cache_gb, a.compile, a.plain_compile = 4.0, "off", False
    device = torch.device(a.device)
    with tempfile.TemporaryDirectory() as tmp:
        cache = cached_features(prepared(a, tmp) / "train", feature_settings(PRESETS[a.preset]), 2)
        vocab = [BLANK] + sorted({w for u in cache.utts for w in u["words"]})
        ds = UtteranceSet(cache, vocab)
        cfg = bench_config(a, device, ds.lengths)
        ops = measure(cfg, ds, device, len(vocab), a.steps)
        tiny = dataclasses.replace(cfg, hidden=a.hidden, context=a.context, batch_size=1)
        ours, plain = pair(tiny, ds, device, len(vocab), a.steps)
        torch.set_num_threads(1)  # host overhead is single-threaded; idle intra-op threads only add noise
        rounds = []
        for _ in range(a.rounds):
            t0 = time.process_time()  # CPU seconds: less hit by other processes than wall time
            ours.run(a.steps)
            t1 = time.process_time()
            plain.run()
            rounds.append((t1 - t0, time.process_time() - t1))
    us = {
        "ours": statistics.median(o for o, _ in rounds) / a.steps * 1e6,
        "plain": statistics.median(p for _, p in rounds) / a.steps * 1e6,
        "ratio_ours_over_plain": statistics.median(o / p for o, p in rounds),
    }
    out = {"ops_per_step": ops, "host_us_per_step": us}
    out |= {"proxy": {"hidden": a.hidden, "context": a.context, "batch": 1}, "device": str(device)}
    print(json.dumps(out, indent=1))
    print(f"wrote {write_result(a.name, out)}")


if __name__ == "__main__":
    main()
