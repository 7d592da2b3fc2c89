"""Model parallel (pipeline stages) x data parallel framework.

    blocks = as_blocks(model)                          # the app's model as an nn.Sequential of blocks
    mesh = ParallelDims(world_size=N, mp=K).build_mesh(device.type)   # (dp=N/K, mp=K)
    pp = parallelize_pipeline(blocks, mesh, device, loss_fn, n_microbatches=M)
    loss = pp.train_step(inputs, targets, batch_size)  # GPipe over P2P, then grad all-reduce over mesh["dp"]

`PipelineTrainer` is the step loop (checkpoints per stage, resume, metrics) for K > 1 jobs.
"""

from .parallelize import PipelineParallel, parallelize_pipeline
from .schedule import GPipeSchedule
from .stages import balanced_boundaries, optimizer_state_bytes, param_bytes, split_blocks

__all__ = [
    "GPipeSchedule",
    "PipelineParallel",
    "balanced_boundaries",
    "optimizer_state_bytes",
    "param_bytes",
    "parallelize_pipeline",
    "split_blocks",
]
