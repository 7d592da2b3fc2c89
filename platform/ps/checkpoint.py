"""`ServerCheckpointer`: the Trainer's checkpointer in a parameter-server job (the servers hold the state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .worker_step import PSWorkerStep


class ServerCheckpointer:
    """Checkpoints of a parameter-server job: worker 0 asks the servers to write their shards (the
    servers' own atomic protocol, `ParamServer.checkpoint`); on start every worker asks the servers at
    which step to continue (0 on a fresh job). The final checkpoint is written after all workers are done
    (by the job's end), not here."""

    resume_from_servers = True

    def __init__(self, client, worker: int, total: int, steps_per_epoch: int):
        self.client, self.worker, self.total, self.spe = client, worker, total, steps_per_epoch

    def save(self, step: PSWorkerStep, progress: dict[str, Any]) -> None:
        n = progress["step"]
        if self.worker == 0 and n < self.total:
            step.wait_mapped()
            self.client.checkpoint(n)

    def load(self, step: PSWorkerStep) -> dict[str, Any] | None:
        n = self.client.resume_step()
        if n <= 0:
            return None
        epoch, pos = divmod(n, self.spe)
        state = {"step": n, "data": {"epoch": epoch, "batch": pos}}
        step.restore(state, Path("."))
        return state
