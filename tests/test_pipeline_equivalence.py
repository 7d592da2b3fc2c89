"""Pipeline framework: stage cutting, and real 2- and 3-process (gloo) pipelines whose loss and gradients
equal the unsplit model's on a fixed batch, for every schedule: torch.distributed.pipelining's 1F1B and
GPipe, the hand-written GPipe, and the batches torch's schedules cannot take (fewer micro-batches than
stages, unequal micro-batches), which fall back to the hand-written one.

Run as a script under torchrun, this file is the worker: ``python -m torch.distributed.run --standalone
--nproc-per-node K tests/test_pipeline_equivalence.py OUT`` writes each stage's loss and gradients per case.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
SEED, BATCH = 7, 12


def _model():
    from mariana.apps.vision.model import mariana_cnn_32

    torch.manual_seed(SEED)
    return mariana_cnn_32(num_classes=10, dropout=0.0)  # no dropout: the RNG streams differ per process


def _batch():
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _loss(logits, y):
    return F.cross_entropy(logits, y)


# (schedule asked for, micro-batches, the schedule that must run it with K stages); BATCH = 12
CASES = [
    ("1f1b", 4, "1f1b (torch.distributed.pipelining)"),
    ("1f1b", 6, "1f1b (torch.distributed.pipelining)"),  # more micro-batches than stages: steady 1F1B
    ("gpipe", 4, "gpipe (torch.distributed.pipelining)"),
    ("p2p", 4, "gpipe (hand-written p2p)"),
    ("1f1b", 1, "gpipe (hand-written p2p)"),  # fewer micro-batches than stages: fallback
    ("1f1b", 5, "gpipe (hand-written p2p)"),  # 12 = 3+3+2+2+2 unequal micro-batches: fallback
]


def worker(out: Path) -> None:
    import torch.distributed as dist
    from mariana.platform.pipeline import parallelize_pipeline
    from mariana.platform.runtime.dist import ParallelDims, init_distributed, teardown

    torch.set_num_threads(1)
    ctx = init_distributed("cpu", 60.0, watchdog=False)
    try:
        mesh = ParallelDims(world_size=ctx.world_size, mp=ctx.world_size).build_mesh("cpu")
        x, y = _batch()
        results = []
        for schedule, micro, _ in CASES:
            pp = parallelize_pipeline(
                _model(), mesh, ctx.device, _loss, n_microbatches=micro, schedule=schedule
            )
            loss = pp.train_step(x if pp.is_first else None, y if pp.is_last else None, BATCH)
            grads = {n: p.grad for n, p in pp.stage.named_parameters()}
            results.append({"loss": loss, "grads": grads, "stage": pp.stage_index, "ran": pp.last_schedule})
        torch.save(results, out / f"rank{dist.get_rank()}.pt")
    finally:
        teardown(ctx)


# ------------------------------------------------------------------------------------------------ tests
def test_balanced_boundaries_minimise_largest_stage():
    from mariana.platform.pipeline import balanced_boundaries

    assert balanced_boundaries([1, 1, 1, 1], 2) == [2]
    assert balanced_boundaries([5, 1, 1, 1, 1, 1], 2) == [1]
    assert balanced_boundaries([1, 2, 3, 4, 5, 6], 3) == [3, 5]  # [1+2+3 | 4+5 | 6] -> max 9
    with pytest.raises(Exception, match="cannot cut"):
        balanced_boundaries([1.0], 2)


def test_split_keeps_block_names_and_function():
    from mariana.apps.vision.model import as_blocks, build_model
    from mariana.platform.pipeline import split_blocks

    model = build_model("resnet18", 10).eval()
    blocks = as_blocks(model)
    stages = split_blocks(blocks, 3)
    assert sum(len(s) for s in stages) == len(blocks)
    merged = {k: v for s in stages for k, v in s.state_dict().items()}
    assert merged.keys() == blocks.state_dict().keys()
    x = torch.randn(2, 3, 32, 32)
    y = x
    for s in stages:
        y = s(y)
    torch.testing.assert_close(y, model(x))


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_pipeline_schedules_match_unsplit_model(tmp_path, stages):
    from helpers import run_torchrun

    run_torchrun(__file__, stages, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(stages)]

    model = _model()
    x, y = _batch()
    loss = _loss(model(x), y)
    loss.backward()
    ref = dict(model.named_parameters())
    for i, (schedule, micro, expected) in enumerate(CASES):
        case = f"{schedule} M={micro} K={stages}"
        res = [r[i] for r in ranks]
        assert [r["stage"] for r in res] == list(range(stages))
        assert all(r["ran"] == expected for r in res), (case, [r["ran"] for r in res])
        assert all(r["loss"] is None for r in res[:-1])  # only the last stage computes the loss
        torch.testing.assert_close(res[-1]["loss"], loss.detach(), atol=1e-5, rtol=1e-5, msg=case)
        got = {k: v for r in res for k, v in r["grads"].items()}
        assert got.keys() == ref.keys()
        assert sum(len(r["grads"]) for r in res) == len(ref)  # each parameter lives on exactly one stage
        for name, g in got.items():
            torch.testing.assert_close(g, ref[name].grad, atol=1e-5, rtol=1e-5, msg=f"{case}: {name}")


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
