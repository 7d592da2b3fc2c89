"""`Prefetcher.close` on a stream stopped mid-epoch (``--max-steps`` before the epoch's end): the thread
has ended and the source is closed when ``close`` returns, so no daemon thread is left inside torch when
the interpreter exits (an abort, exit -6, seen once in `pctr train --max-steps 3`)."""

import threading
import time

import torch
from mariana.platform.core.prefetch import Prefetcher


def test_close_mid_stream_ends_the_thread_and_closes_the_source():
    closed = threading.Event()

    def source():
        try:
            for i in range(1000):
                time.sleep(0.05)  # a slow parse: the thread is busy when the consumer stops
                yield torch.full((4,), float(i))
        finally:
            closed.set()

    p = Prefetcher(source(), depth=2)
    assert float(next(p)[0]) == 0.0
    p.close()
    assert not p.t.is_alive()  # returned only once the thread had ended
    assert closed.is_set()  # the source's own clean-up ran (its pools, its files)
