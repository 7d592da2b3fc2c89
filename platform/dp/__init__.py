"""Data-parallel framework: process groups, DDP with gradient compression, sharded sampling, torchrun launch, watchdog."""
