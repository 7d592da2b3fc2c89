"""Data-parallel framework: DDP with gradient compression (`ddp`) and sharded sampling (`sampler`); the
process groups, torchrun launch and watchdog it runs on are the shared `mariana.platform.runtime`."""
