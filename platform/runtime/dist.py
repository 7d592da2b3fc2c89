"""Process-group set-up from torchrun's environment, and the parallel dimensions of a job.

`init_distributed` reads RANK/WORLD_SIZE/LOCAL_RANK (set by torchrun); without them the job is one
process and no process group is created. The backend follows the device: NCCL for CUDA, gloo for CPU.
`ParallelDims` (after torchtitan) validates that the parallel degrees multiply to the world size and
builds the named DeviceMesh the ``parallelize`` functions take.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.errors import MarianaError
from .watchdog import Watchdog


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    watchdog: Watchdog | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def beat(self, step: int, phase: str = "data") -> None:
        if self.watchdog is not None:
            self.watchdog.beat(step, phase)

    def set_phase(self, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.set_phase(phase)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise MarianaError("--device cuda was asked for, but CUDA is not available on this machine")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if device != "cpu":
        raise MarianaError(f"--device must be auto, cpu or cuda, got {device!r}")
    return torch.device("cpu")


def init_distributed(device: str = "auto", timeout_s: float = 300.0, watchdog: bool = True) -> DistContext:
    """Join the job's process group (if launched by torchrun) and pick this rank's device.

    ``timeout_s`` arms the hang watchdog; the process group's own timeout is set later than it, so the
    watchdog (which names the stalled rank) fires first and the backend timeout is only a backstop."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    ctx = DistContext(rank=rank, world_size=world, local_rank=local_rank, device=dev)
    if world > 1:
        ctx.backend = "nccl" if dev.type == "cuda" else "gloo"
        if not dist.is_initialized():
            _init_process_group(ctx.backend, rank, world, timedelta(seconds=2 * timeout_s + 30))
        if watchdog:
            ctx.watchdog = Watchdog(rank, world, timeout_s)
    # One CPU thread per process when several share a machine (oversubscription costs more than it gives).
    if dev.type == "cpu" and world > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    return ctx


def _init_process_group(backend: str, rank: int, world: int, timeout: timedelta) -> None:
    """Join the default process group.

    Under torchrun the agent hosts the TCPStore and (with c10d rendezvous, torch 2.9) keeps the same store
    across worker-group restarts, so a restarted group would read the dead group's gloo addresses. Keys are
    therefore prefixed with the restart attempt. Other launchers (RANK/WORLD_SIZE/MASTER_* only) use env://.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        base = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
        )
        store = dist.PrefixStore(f"mariana/attempt_{attempt}", base)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)


def teardown(ctx: DistContext | None = None) -> None:
    """Stop the watchdog and destroy the process group; safe to call twice or without one."""
    if ctx is not None and ctx.watchdog is not None:
        ctx.watchdog.stop()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class ParallelDims:
    """Parallel degrees of a job: ``dp`` data-parallel groups x ``mp`` model-parallel stages."""

    world_size: int
    dp: int = -1  # -1: whatever is left after mp
    mp: int = 1

    def __post_init__(self):
        if self.mp < 1 or self.world_size % self.mp:
            raise MarianaError(f"--workers {self.world_size} is not divisible by --model-parallel {self.mp}")
        if self.dp == -1:
            self.dp = self.world_size // self.mp
        if self.dp * self.mp != self.world_size:
            raise MarianaError(
                f"dp {self.dp} x mp {self.mp} = {self.dp * self.mp} != world size {self.world_size}"
            )

    def build_mesh(self, device_type: str = "cpu"):
        """A DeviceMesh of shape (dp, mp) named ("dp", "mp"): ranks r = g*mp + s hold stage s of group g."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp, self.mp), mesh_dim_names=("dp", "mp"))
