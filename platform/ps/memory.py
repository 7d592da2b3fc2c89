"""Table memory's names for `job.py`, which imports them from here: they live in
`mariana.platform.sparse.memory` (the row stores' tables)."""

from ..sparse.memory import keep_freed_memory, table_empty

__all__ = ["keep_freed_memory", "table_empty"]
