"""`apply_data_parallel`: wrap a plain single-device module in DDP over the data-parallel group.

Gradient communication goes through a DDP communication hook that
- optionally compresses gradients to bf16/fp16 for the all-reduce (half the bytes on the wire),
- times each bucket's all-reduce (``CommStats``: communication seconds and bytes per step, logged by the
  training loop as ``comm_time_s``),
- tells the watchdog this rank reached the collective (phase ``comm``), so a hang report can tell the
  rank that never arrived from the ranks waiting for it.
"""

from __future__ import annotations

import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ..core.errors import MarianaError
from ..core.loop import unwrap  # noqa: F401  (re-exported: the plain module inside DDP/compile)
from ..runtime.dist import DistContext

_HOOKS = {
    "fp32": default_hooks.allreduce_hook,
    "bf16": default_hooks.bf16_compress_hook,
    "fp16": default_hooks.fp16_compress_hook,
}
_WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class CommStats:
    """Accumulated all-reduce time (seconds, summed over buckets; they may overlap backward) and bytes."""

    def __init__(self):
        self.seconds = 0.0
        self.bytes = 0

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.bytes)
        self.seconds, self.bytes = 0.0, 0
        return out


def _timed_hook(inner, stats: CommStats, ctx: DistContext, wire_bytes: int):
    # No annotations here: DDP checks them, and `from __future__ import annotations` makes them strings.
    def hook(state, bucket):
        ctx.set_phase("comm")
        t0 = time.perf_counter()
        stats.bytes += bucket.buffer().numel() * wire_bytes
        fut = inner(state, bucket)

        def done(f):
            stats.seconds += time.perf_counter() - t0
            return f.value()

        return fut.then(done)

    return hook


def apply_data_parallel(
    model: torch.nn.Module, ctx: DistContext, mesh=None, grad_comm: str = "fp32", **ddp_kwargs
) -> torch.nn.Module:
    """Move ``model`` to ``ctx.device`` and, in a multi-process job, wrap it in DDP.

    ``mesh``: a DeviceMesh with a ``dp`` dimension (gradients are all-reduced over that group only);
    None uses the whole world. ``grad_comm``: fp32 | bf16 | fp16 all-reduce precision.
    The returned module has ``comm_stats`` (a `CommStats`) in both cases."""
    if grad_comm not in _HOOKS:
        raise MarianaError(f"--grad-comm must be one of {sorted(_HOOKS)}, got {grad_comm!r}")
    model = model.to(ctx.device)
    stats = CommStats()
    if not ctx.distributed:
        model.comm_stats = stats  # type: ignore[attr-defined]
        return model
    group = mesh.get_group("dp") if mesh is not None else None
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # Gradients live in the all-reduce buckets (no copy in/out of the buckets each step).
    ddp_kwargs.setdefault("gradient_as_bucket_view", True)
    ddp = DDP(model, device_ids=device_ids, process_group=group, **ddp_kwargs)
    ddp.register_comm_hook(group, _timed_hook(_HOOKS[grad_comm], stats, ctx, _WIRE_BYTES[grad_comm]))
    ddp.comm_stats = stats  # type: ignore[attr-defined]
    return ddp
