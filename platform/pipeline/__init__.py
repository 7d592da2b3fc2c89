"""Model parallel (pipeline stages) x data parallel framework.

    blocks = as_blocks(model)                          # the app's model as an nn.Sequential of blocks
    mesh = ParallelDims(world_size=N, mp=K).build_mesh(device.type)   # (dp=N/K, mp=K)
    pp = parallelize_pipeline(blocks, mesh, device, loss_fn, n_microbatches=M, schedule="1f1b")
    loss = pp.train_step(inputs, targets, batch_size)  # 1F1B/GPipe over P2P, then grad all-reduce over mesh["dp"]

`PipelineStep` (``step.py``) is the core `Trainer`'s step for K > 1 jobs: grad accumulation, global
gradient clipping across stages, per-stage checkpoints, the merged full state dict for export.
"""

from .parallelize import SCHEDULES, PipelineParallel, parallelize_pipeline
from .schedule import GPipeSchedule, TorchSchedule
from .stages import balanced_boundaries, optimizer_state_bytes, param_bytes, split_blocks
from .step import PipelineStep

__all__ = [
    "SCHEDULES",
    "GPipeSchedule",
    "PipelineParallel",
    "PipelineStep",
    "TorchSchedule",
    "balanced_boundaries",
    "optimizer_state_bytes",
    "param_bytes",
    "parallelize_pipeline",
    "split_blocks",
]
