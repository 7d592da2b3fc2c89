"""Parameter-server framework: sharded embedding tables on RPC servers, asynchronous (or bounded-stale,
or bulk-synchronous) sparse pull/push from workers, a torchrun-launched master that restarts failures and
restores checkpoints, and per-worker counters. See server.py, worker.py, master.py, runtime.py."""

from .rowopt import RowOptConfig, apply_rows, coalesce
from .shard import EmbeddingShard, TableSpec, split_by_shard

__all__ = ["EmbeddingShard", "RowOptConfig", "TableSpec", "apply_rows", "coalesce", "split_by_shard"]
