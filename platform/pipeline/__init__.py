"""Model parallel (pipeline stages) x data parallel framework; usage and design: README.md."""

from .parallelize import SCHEDULES, PipelineParallel, parallelize_pipeline
from .schedule import GPipeSchedule, TorchSchedule
from .stages import balanced_boundaries, optimizer_state_bytes, param_bytes, split_blocks
from .step import PipelineStep
