"""One background-thread prefetcher for every data path (parsing, decoding and host->device copies
overlap the training step)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

JOIN_S = 60.0  # the longest `Prefetcher.close` waits for the item in hand (a parse of one block, a decode)


class Prefetcher:
    """Iterate ``it`` in a background thread, ``depth`` items ahead of the consumer.

    ``device``: tensors (also inside tuples/lists/dicts) are copied there with ``non_blocking=True``, on a side
    CUDA stream when it is a GPU (the consumer waits on an event before using a batch). ``transform(item)``
    runs in the thread too (e.g. batched JPEG decoding). An exception in the thread is re-raised in the
    consumer; ``close()`` stops the thread early (e.g. when training stops mid-epoch)."""

    _END = object()

    def __init__(
        self,
        it: Iterator,
        depth: int = 2,
        device: torch.device | None = None,
        transform: Callable[[Any], Any] | None = None,
    ):
        self.q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.device, self.transform = device, transform
        self.stream = torch.cuda.Stream() if device is not None and device.type == "cuda" else None
        self.err: BaseException | None = None
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, args=(it,), daemon=True)
        self.t.start()

    def _move(self, item):
        if isinstance(item, torch.Tensor):
            return item.to(self.device, non_blocking=True)
        if isinstance(item, tuple | list):
            return type(item)(self._move(b) for b in item)
        if isinstance(item, dict):
            return {k: self._move(v) for k, v in item.items()}
        return item

    def _prepare(self, item):
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                item = self._move(item)
                if self.transform is not None:
                    item = self.transform(item)
            ev = torch.cuda.Event()
            ev.record(self.stream)
            return item, ev
        if self.device is not None:
            item = self._move(item)
        return (self.transform(item) if self.transform is not None else item), None

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, it):
        try:
            for item in it:
                if not self._put(self._prepare(item)):
                    return
        except BaseException as e:  # re-raised in the consumer
            self.err = e
        finally:
            if self.stop.is_set():  # closed early: end the source here, in its own thread (its pools, files)
                close = getattr(it, "close", None)
                if close is not None:
                    close()
        self._put(self._END)

    def __iter__(self):
        return self

    def __next__(self):
        item = self.q.get()
        if item is self._END:
            if self.err is not None:
                raise self.err
            raise StopIteration
        batch, ev = item
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)
            _record_stream(batch, torch.cuda.current_stream())
        return batch

    def close(self) -> None:
        """Stop the thread and wait for it: it ends after the item in hand (a training that stops before
        the epoch's end leaves it parsing). A daemon thread still inside torch or numpy when the interpreter
        exits can abort the process ("terminate called without an active exception", exit -6)."""
        self.stop.set()
        if self.t is not threading.current_thread():
            self.t.join(timeout=JOIN_S)


def _record_stream(batch, stream) -> None:
    """Tell the caching allocator the batch (allocated on the copy stream) is used on ``stream``."""
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, tuple | list):
        for b in batch:
            _record_stream(b, stream)
    elif isinstance(batch, dict):
        for b in batch.values():
            _record_stream(b, stream)
