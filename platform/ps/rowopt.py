"""The row rules' names for the server framework's modules that import them from here (`server.py`,
`job.py`): the rules live in `mariana.platform.sparse.rules`."""

from ..sparse.rules import RULES, RowOptConfig, apply_rows, coalesce, init_state

__all__ = ["RULES", "RowOptConfig", "apply_rows", "coalesce", "init_state"]
