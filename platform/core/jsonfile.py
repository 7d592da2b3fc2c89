"""Strict JSON for every file the platform writes: NaN and +-inf become ``null``.

Python's ``json.dumps`` writes a bare ``NaN``/``Infinity`` by default, which is not JSON (browsers, ``jq``
and most other languages refuse the file). A metric that could not be computed (no validation rows, one
class only, a file that yielded no rows) is written as ``null`` instead."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (at any depth of dicts, lists and tuples) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def read_json(path: str | Path) -> Any:
    """The JSON value in the file ``path``; None when it is missing, unreadable or not JSON (a torn write)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def dumps(obj: Any, **kw) -> str:
    """``json.dumps(finite(obj), allow_nan=False, **kw)``: always valid JSON."""
    return json.dumps(finite(obj), allow_nan=False, **kw)
