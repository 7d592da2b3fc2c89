"""Pipeline framework: stage cutting, and real 2- and 3-process (gloo) pipelines whose loss and gradients
equal the unsplit model's on a fixed batch, for every schedule: torch.distributed.pipelining's 1F1B and
GPipe, the hand-written GPipe, and the batches torch's schedules cannot take (fewer micro-batches than
stages, unequal micro-batches), which fall back to the hand-written one.

The 2-process launch also checks `PipelineStep` (the core Trainer's step for pipeline jobs) on its 2-stage
pipeline:

- ``--clip-grad`` clips by the whole model's gradient norm (summed over the stages): one clipped step
  gives the unsplit model's parameters after `torch.nn.utils.clip_grad_norm_` and the same optimizer step;
- ``--grad-accum 2`` with half batches gives the parameters of one step on the whole batch;
- `full_state_dict` (a collective) assembles the whole model on rank 0; `restore` refuses a checkpoint
  with another number of stages;
- torch's schedules leave no trace of their runtime shape inference: with BatchNorm and dropout, a 1F1B
  step gives the hand-written schedule's gradients, running statistics and RNG state (a resumed run,
  which infers shapes again, stays exact).

One torchrun launch per number of stages serves every test that needs it (a module fixture), and the
unsplit references are computed in the test process. Run as a script under torchrun, this file is the
worker: ``python -m torch.distributed.run --standalone --nproc-per-node K tests/test_pipeline_equivalence.py
OUT`` writes each stage's loss and gradients per case to OUT/rankR.pt, and with K = 2 the `PipelineStep`
results to OUT/step-rankR.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
SEED, BATCH = 7, 12
SEED_BN, CLIP = 11, 0.05


def _model():
    from mariana.apps.vision.model import mariana_cnn_32

    torch.manual_seed(SEED)
    return mariana_cnn_32(num_classes=10, dropout=0.0)  # no dropout: the RNG streams differ per process


def _batch():
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _loss(logits, y):
    return F.cross_entropy(logits, y)


def _cfg(**kw):
    from mariana.platform.core.config import TrainConfig

    base = {"optimizer": "sgd", "lr": 0.5, "momentum": 0.0, "weight_decay": 0.0, "progress": False}
    return TrainConfig(**{**base, **kw})


def _bn_dropout_model() -> torch.nn.Sequential:
    from torch import nn

    torch.manual_seed(SEED_BN)
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5)),
        nn.Sequential(nn.Conv2d(8, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten()),
        nn.Sequential(nn.Dropout(0.5), nn.Linear(8 * 15 * 15, 10)),
    )


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
    """Every schedule case on this launch's K-stage pipeline -> OUT/rankR.pt; with K = 2 also the
    `PipelineStep` checks -> OUT/step-rankR.pt."""
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
        if ctx.world_size == 2:
            torch.save(step_worker(out, ctx, mesh), out / f"step-rank{dist.get_rank()}.pt")
    finally:
        teardown(ctx)


def step_worker(out: Path, ctx, mesh) -> dict:
    """`PipelineStep` on the 2-stage pipeline: a clipped step, a plain one, a 2-way accumulated one (their
    merged state dicts, on rank 0), a refused restore, and one BatchNorm + dropout step per schedule."""
    from mariana.platform.core.errors import MarianaError
    from mariana.platform.core.rundir import RunDir
    from mariana.platform.pipeline import PipelineStep, parallelize_pipeline

    x, y = _batch()

    def one_step(name: str, cfg, micro: int, pieces: int):
        pp = parallelize_pipeline(_model(), mesh, ctx.device, _loss, n_microbatches=micro)
        step = PipelineStep(cfg, pp, ctx, RunDir(out / name))
        step.setup(10)
        batches = [
            (xs if pp.is_first else None, ys if pp.is_last else None, len(ys))
            for xs, ys in zip(torch.tensor_split(x, pieces), torch.tensor_split(y, pieces))
        ]
        loss, n = step.train_step(batches)
        return step, pp, loss, n

    res: dict = {}
    step, pp, loss, n = one_step("clip", _cfg(clip_grad=CLIP), 4, 1)
    res["clip"] = step.full_state_dict()
    res["clip_loss"] = step.mean_loss(loss, 1)
    res["clip_samples"] = n
    res["schedule"] = pp.last_schedule
    try:
        step.restore({"pipeline": {"stages": 3, "groups": 1}}, out / "clip" / "checkpoints" / "step_1")
    except MarianaError as e:
        res["restore_error"] = str(e)
    step, _, _, _ = one_step("whole", _cfg(), 4, 1)
    res["whole"] = step.full_state_dict()
    step, _, _, n = one_step("accum", _cfg(grad_accum=2), 2, 2)
    res["accum"] = step.full_state_dict()
    res["accum_samples"] = n
    res["report"] = (out / "accum" / "logs" / f"pipeline-rank-{ctx.rank}.json").is_file()
    for schedule in ("p2p", "1f1b"):
        pp = parallelize_pipeline(_bn_dropout_model(), mesh, ctx.device, _loss, 4, [1], schedule=schedule)
        torch.manual_seed(SEED_BN + 1)
        pp.train_step(x if pp.is_first else None, y if pp.is_last else None, BATCH)
        res[f"bn_{schedule}"] = {
            "ran": pp.last_schedule,
            "grads": {n: p.grad for n, p in pp.stage.named_parameters()},
            "buffers": dict(pp.stage.named_buffers()),
            "rng": torch.get_rng_state(),
        }
    return res


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """K -> the output folder of this file run as K torchrun workers (launched once, on first use)."""
    from helpers import run_torchrun

    outs: dict[int, Path] = {}

    def get(stages: int) -> Path:
        if stages not in outs:
            outs[stages] = tmp_path_factory.mktemp(f"pipeline-{stages}")
            run_torchrun(__file__, stages, outs[stages])
        return outs[stages]

    return get


@pytest.fixture(scope="module")
def unsplit():
    """The unsplit model's loss and parameters (with their gradients) on the fixed batch."""
    model = _model()
    x, y = _batch()
    loss = _loss(model(x), y)
    loss.backward()
    return loss.detach(), dict(model.named_parameters())


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
def test_pipeline_schedules_match_unsplit_model(launched, unsplit, stages):
    out = launched(stages)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(stages)]
    loss, ref = unsplit
    for i, (schedule, micro, expected) in enumerate(CASES):
        case = f"{schedule} M={micro} K={stages}"
        res = [r[i] for r in ranks]
        assert [r["stage"] for r in res] == list(range(stages))
        assert all(r["ran"] == expected for r in res), (case, [r["ran"] for r in res])
        assert all(r["loss"] is None for r in res[:-1])  # only the last stage computes the loss
        torch.testing.assert_close(res[-1]["loss"], loss, atol=1e-5, rtol=1e-5, msg=case)
        got = {k: v for r in res for k, v in r["grads"].items()}
        assert got.keys() == ref.keys()
        assert sum(len(r["grads"]) for r in res) == len(ref)  # each parameter lives on exactly one stage
        for name, g in got.items():
            torch.testing.assert_close(g, ref[name].grad, atol=1e-5, rtol=1e-5, msg=f"{case}: {name}")


@pytest.mark.slow
def test_pipeline_step_clipping_accumulation_and_merge(launched):
    from mariana.platform.core.optim import build_optimizer

    out = launched(2)
    r0 = torch.load(out / "step-rank0.pt", weights_only=True)
    r1 = torch.load(out / "step-rank1.pt", weights_only=True)
    assert r0["schedule"] == "1f1b (torch.distributed.pipelining)"
    assert r1["clip"] == {} and r1["whole"] == {}  # the merged model lives on rank 0 only
    assert r0["report"] and r1["report"]  # RUN/logs/pipeline-rank-R.json after the first step
    assert r0["clip_samples"] == r0["accum_samples"] == BATCH
    assert "has 3 pipeline stages, this job has 2" in r0["restore_error"]

    def reference(clip: float) -> tuple[dict[str, torch.Tensor], float, float]:
        model = _model()
        opt = build_optimizer(_cfg(), model.parameters())
        x, y = _batch()
        loss = _loss(model(x), y)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)) if clip else 0.0
        opt.step()
        return model.state_dict(), float(loss.detach()), norm

    init = _model().state_dict()
    clipped, ref_loss, norm = reference(CLIP)
    assert norm > 4 * CLIP  # the clip bites
    assert r0["clip_loss"] == pytest.approx(ref_loss, rel=1e-5)
    whole, _, _ = reference(0.0)
    for name, w in init.items():
        # compare the updates (the parameters move by lr x gradient, small next to the weights)
        for got, ref, what in ((r0["clip"], clipped, "clip"), (r0["whole"], whole, "whole")):
            torch.testing.assert_close(
                got[name] - w, ref[name] - w, atol=1e-7, rtol=1e-4, msg=f"{what}: {name}"
            )
        # --grad-accum 2 with half batches == one step on the whole batch
        torch.testing.assert_close(r0["accum"][name], r0["whole"][name], atol=1e-7, rtol=1e-6, msg=name)
    assert r0["clip"].keys() == r0["whole"].keys() == r0["accum"].keys() == init.keys()
    for r in (r0, r1):  # torch's runtime shape inference left no trace
        ref, got = r["bn_p2p"], r["bn_1f1b"]
        assert (ref["ran"], got["ran"]) == ("gpipe (hand-written p2p)", "1f1b (torch.distributed.pipelining)")
        assert torch.equal(got["rng"], ref["rng"])
        for what in ("grads", "buffers"):
            assert got[what].keys() == ref[what].keys()
            for name, t in ref[what].items():
                torch.testing.assert_close(got[what][name], t, atol=1e-6, rtol=1e-5, msg=f"{what}: {name}")
    update = {n: (clipped[n] - init[n]).norm() / (whole[n] - init[n]).norm() for n in init if "weight" in n}
    assert max(update.values()) < 0.5  # the clipped step is much smaller than the unclipped one


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
