"""Pipeline framework: stage cutting, and a real 2-process (gloo) 2-stage pipeline whose loss and
gradients equal the unsplit model's on a fixed batch.

Run as a script under torchrun, this file is the worker: ``python -m torch.distributed.run --standalone
--nproc-per-node 2 tests/test_pipeline_equivalence.py OUT M`` writes each stage's loss and gradients.
"""

from __future__ import annotations

import subprocess
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


def worker(out: Path, micro: int) -> None:
    import torch.distributed as dist
    from mariana.platform.dp.dist import ParallelDims, init_distributed, teardown
    from mariana.platform.pipeline import parallelize_pipeline

    torch.set_num_threads(1)
    ctx = init_distributed("cpu", 60.0, watchdog=False)
    try:
        mesh = ParallelDims(world_size=ctx.world_size, mp=2).build_mesh("cpu")
        pp = parallelize_pipeline(_model(), mesh, ctx.device, _loss, n_microbatches=micro)
        x, y = _batch()
        loss = pp.train_step(x if pp.is_first else None, y if pp.is_last else None, BATCH)
        grads = {n: p.grad for n, p in pp.stage.named_parameters()}
        torch.save({"loss": loss, "grads": grads, "stage": pp.stage_index}, out / f"rank{dist.get_rank()}.pt")
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
@pytest.mark.parametrize("micro", [1, 4])
def test_two_stage_pipeline_matches_unsplit_model(tmp_path, micro):
    from helpers import cli_env

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            __file__,
            str(tmp_path),
            str(micro),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env=cli_env(),  # the shared test environment: 1 thread per process, no stray torchrun variables
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert (r0["stage"], r1["stage"]) == (0, 1)
    assert r0["loss"] is None  # only the last stage computes the loss

    model = _model()
    x, y = _batch()
    loss = _loss(model(x), y)
    loss.backward()
    torch.testing.assert_close(r1["loss"], loss.detach(), atol=1e-5, rtol=1e-5)
    ref = dict(model.named_parameters())
    got = {**r0["grads"], **r1["grads"]}
    assert got.keys() == ref.keys()
    assert set(r0["grads"]).isdisjoint(r1["grads"])  # each parameter lives on exactly one stage
    for name, g in got.items():
        torch.testing.assert_close(g, ref[name].grad, atol=1e-5, rtol=1e-5, msg=name)


if __name__ == "__main__":
    worker(Path(sys.argv[1]), int(sys.argv[2]))
