"""Micro-batching of concurrent requests onto one inference thread.

One collector task per model takes everything queued (up to ``max_batch`` instances, whole requests
only), waits for company only while other requests are already inside the server (`expect`/`arrived`)
and at most ``max_wait_s``, and runs ``fn(items)`` on a dedicated thread: the event loop keeps accepting
requests and the model never sees two callers at once. While one batch runs the next one queues, so
under load batches grow by themselves.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mariana.platform.core.errors import MarianaError


class Overloaded(MarianaError):
    """The queue already holds ``max_queue`` instances; the client should retry later (HTTP 503)."""


class MicroBatcher:
    """``await submit(items)`` -> ``(results for these items, meta)``.

    ``fn(flat_items: list) -> (results: list aligned with flat_items, meta)`` runs on the inference thread
    with the concatenation of several requests' items; ``meta`` (e.g. the model version that answered) is
    handed to every request of that batch. An exception from ``fn`` fails only that batch's requests.
    Batches of at most ``inline_max`` instances run on the event loop thread itself (a tiny model call costs
    less than handing it to another thread and getting the GIL back); larger ones on the inference thread.
    Either way one batch runs at a time. ``on_batch(n_items, seconds)`` and ``on_queue(depth)`` feed the
    metrics.
    """

    def __init__(
        self,
        fn: Callable[[list], tuple[Sequence[Any], Any]],
        executor: ThreadPoolExecutor,
        max_batch: int = 2048,
        max_wait_s: float = 0.0005,
        max_queue: int = 200_000,
        inline_max: int = 0,
        on_batch: Callable[[int, float], None] | None = None,
        on_queue: Callable[[int], None] | None = None,
    ):
        self.fn, self.executor = fn, executor
        self.max_batch, self.max_wait_s, self.max_queue = max(1, max_batch), max(0.0, max_wait_s), max_queue
        self.on_batch, self.on_queue = on_batch, on_queue
        self.inline_max = inline_max
        self._queue: deque[tuple[list, asyncio.Future, float]] = deque()
        self._queued = 0  # instances waiting
        self._wake: asyncio.Event | None = None
        self.expected = 0  # requests inside the server that will submit soon (see `expect`)
        self._task: asyncio.Task | None = None

    @property
    def depth(self) -> int:
        return self._queued

    def start(self) -> None:
        """Start the collector on the running event loop (called from the app's lifespan)."""
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._collect(), name="micro-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        while self._queue:
            _, fut, _ = self._queue.popleft()
            if not fut.done():
                fut.set_exception(Overloaded("server is shutting down"))

    def expect(self, scope: dict) -> None:
        """A request for this model has arrived (called at the start of its HTTP handling)."""
        self.expected += 1
        scope["mariana.expected"] = True

    def arrived(self, scope: dict) -> None:
        """That request is about to submit, or has failed before it: it no longer counts as expected."""
        if scope.pop("mariana.expected", False):
            self.expected -= 1

    async def submit(self, items: list) -> tuple[list, Any]:
        if self._task is None:
            self.start()
        if self._queued + len(items) > self.max_queue:
            raise Overloaded(f"server overloaded: {self._queued} instances already queued")
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((items, fut, time.perf_counter()))
        self._queued += len(items)
        if self.on_queue:
            self.on_queue(self._queued)
        self._wake.set()
        return await fut

    def _take(self) -> list[tuple[list, asyncio.Future, float]]:
        batch, n = [], 0
        while self._queue and (not batch or n + len(self._queue[0][0]) <= self.max_batch):
            entry = self._queue.popleft()
            n += len(entry[0])
            if entry[1].cancelled():  # the client went away while queued
                self._queued -= len(entry[0])
                n -= len(entry[0])
                continue
            batch.append(entry)
        self._queued -= n
        if self.on_queue:
            self.on_queue(self._queued)
        return batch

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._queue:
                continue
            # Wait for company only while other requests are already inside the server (arrived, being
            # parsed/validated) and the oldest queued one has waited less than max_wait_s. Yielding to the
            # event loop (instead of sleeping on a timer, whose resolution is 1 ms) lets them catch up; an
            # isolated request is dispatched at once.
            while self.expected > 0 and self._queued < self.max_batch and self._queue:
                if time.perf_counter() - self._queue[0][2] >= self.max_wait_s:
                    break
                await asyncio.sleep(0)
            batch = self._take()
            if not batch:
                continue
            flat = [x for items, _, _ in batch for x in items]
            t0 = time.perf_counter()
            try:
                if len(flat) <= self.inline_max:  # small: cheaper than two thread switches and a GIL hand-off
                    results, meta = self.fn(flat)
                else:
                    results, meta = await loop.run_in_executor(self.executor, self.fn, flat)
                if len(results) != len(flat):
                    raise RuntimeError(f"model answered {len(results)} results for {len(flat)} instances")
            except Exception as e:  # noqa: BLE001  -- fail this batch's requests, keep serving
                for _, fut, _ in batch:
                    if not fut.done():
                        fut.set_exception(e)
            else:
                off = 0
                for items, fut, _ in batch:
                    if not fut.done():
                        fut.set_result((list(results[off : off + len(items)]), meta))
                    off += len(items)
            if self.on_batch:
                self.on_batch(len(flat), time.perf_counter() - t0)
            if self._queue:
                self._wake.set()
