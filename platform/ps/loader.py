"""`PullAheadLoader`: the `BatchLoader` of a parameter-server worker that sends the pull of batch t+1
before batch t goes to the step, so those rows travel while step t computes."""

from __future__ import annotations

from collections.abc import Iterator

from .pull import Pulled
from .worker_step import PSWorkerStep


class PullAheadLoader:
    """`BatchLoader` of a parameter-server worker: hands out `Pulled` batches, sending the pull of batch
    t+1 before batch t goes to the step, so those rows travel while step t computes."""

    def __init__(self, loader, step: PSWorkerStep):
        self.loader, self.step = loader, step
        self.batches_per_epoch = loader.batches_per_epoch

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Pulled]:
        it = iter(self.loader.iterate(epoch, start))
        try:
            nxt = next(it, None)
            ahead = None if nxt is None else self.step.send_pull(nxt, self.step.t)
            while ahead is not None:
                cur = ahead
                nxt = next(it, None)
                ahead = None if nxt is None else self.step.send_pull(nxt, self.step.t + 1)
                yield cur
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()  # the parsing thread
