"""`PipelineStep` (the core Trainer's step for pipeline jobs) on a real 2-process (gloo) 2-stage pipeline:

- ``--clip-grad`` clips by the whole model's gradient norm (summed over the stages): one clipped step
  gives the unsplit model's parameters after `torch.nn.utils.clip_grad_norm_` and the same optimizer step;
- ``--grad-accum 2`` with half batches gives the parameters of one step on the whole batch;
- `full_state_dict` (a collective) assembles the whole model on rank 0; `restore` refuses a checkpoint
  with another number of stages;
- torch's schedules leave no trace of their runtime shape inference: with BatchNorm and dropout, a 1F1B
  step gives the hand-written schedule's gradients, running statistics and RNG state (a resumed run,
  which infers shapes again, stays exact).

Run as a script under torchrun, this file is the worker: ``python -m torch.distributed.run --standalone
--nproc-per-node 2 tests/test_pipeline_step.py OUT``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_pipeline_equivalence import BATCH, _batch, _loss, _model

ROOT = Path(__file__).resolve().parents[1]
CLIP = 0.05


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


SEED_BN = 11


def worker(out: Path) -> None:
    import torch.distributed as dist
    from mariana.platform.core.errors import MarianaError
    from mariana.platform.core.rundir import RunDir
    from mariana.platform.pipeline import PipelineStep, parallelize_pipeline
    from mariana.platform.runtime.dist import ParallelDims, init_distributed, teardown

    torch.set_num_threads(1)
    ctx = init_distributed("cpu", 60.0, watchdog=False)
    try:
        mesh = ParallelDims(world_size=ctx.world_size, mp=2).build_mesh("cpu")
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
        res["report"] = (out / "accum" / "logs" / f"pipeline-rank-{dist.get_rank()}.json").is_file()
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
        torch.save(res, out / f"rank{dist.get_rank()}.pt")
    finally:
        teardown(ctx)


@pytest.mark.slow
def test_pipeline_step_clipping_accumulation_and_merge(tmp_path):
    from helpers import run_torchrun
    from mariana.platform.core.optim import build_optimizer

    run_torchrun(__file__, 2, tmp_path)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
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
