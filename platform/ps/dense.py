"""Dense parameters held by the parameter servers: one flat vector cut into S contiguous slices, server
``s`` holding slice ``s`` (`shard.contiguous_part`) and a torch optimiser over it.

Workers pull every slice (together ``[P]`` float32), unflatten the vector into their model, and push each
server its slice of the flat gradient; the optimisers (SGD, Adam, Adagrad) are elementwise, so S slices
step exactly as one vector would. Like a shard, a store remembers each worker's last applied step so
replayed pushes apply once."""

from __future__ import annotations

import threading

import torch

from ..core.errors import MarianaError
from ..core.optim import fused_supported


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def unflatten_into(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    """Copy ``flat [P]`` into ``params`` in order (sizes must add up to P)."""
    off = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[off : off + n].view_as(p))
            off += n


def build_dense_optimizer(name: str, params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adam":
        # The fused kernel: one pass over each tensor instead of one per arithmetic op.
        return torch.optim.Adam(params, lr=lr, fused=fused_supported(params))
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    raise ValueError(f"unknown dense optimiser {name!r} (sgd, adam, adagrad)")


class DenseStore:
    def __init__(self, init: torch.Tensor, optimizer: str, lr: float):
        self.param = torch.nn.Parameter(init.detach().clone().float())
        self.opt = build_dense_optimizer(optimizer, [self.param], lr)
        self.lock = threading.Lock()
        self.last_step: dict[int, int] = {}

    def pull(self) -> torch.Tensor:
        with self.lock:
            return self.param.detach().clone()

    def push(self, grad: torch.Tensor, worker: int = -1, step: int = -1, scale: float = 1.0) -> bool:
        with self.lock:
            if worker >= 0:
                if step <= self.last_step.get(worker, -1):
                    return False
                self.last_step[worker] = step
            if self.param.numel() == 0:
                return True
            self.param.grad = grad.to(self.param.device).float() * scale
            self.opt.step()
            self.param.grad = None
        return True

    def worker_step(self, worker: int) -> int:
        return self.last_step.get(worker, -1)

    def state_dict(self) -> dict:
        with self.lock:
            return {
                "param": self.param.detach().cpu().clone(),
                "opt": self.opt.state_dict(),
                "last_step": {str(k): v for k, v in self.last_step.items()},
            }

    def load_state_dict(self, sd: dict) -> None:
        if sd["param"].shape != self.param.shape:
            raise MarianaError(
                f"checkpoint holds a dense slice of {sd['param'].numel()} values where this server holds "
                f"{self.param.numel()}: it was written by a job with another --servers count or model"
            )
        with self.lock:
            with torch.no_grad():
                self.param.copy_(sd["param"])
            self.opt.load_state_dict(sd["opt"])
            self.last_step = {int(k): int(v) for k, v in sd["last_step"].items()}
