"""The one row-split rule of the platform: a data file's rows split by row order into train | val | test.

Both click apps use it (``pctr --split TR,VA,TE``; ``mlp --val-fraction --test-fraction``), for training
and for ``eval --split``, so an evaluation scores exactly the rows the run's own split gave that name."""

from __future__ import annotations


def split_bounds(total: int, fractions: tuple[float, float, float]) -> dict[str, tuple[int, int]]:
    """Row ranges ``[start, end)`` of ``total`` rows for ``fractions`` = (train, val, test), by row order:
    {'train': (0, a), 'val': (a, b), 'test': (b, total), 'all': (0, total)} with the cut points rounded to
    the nearest row, ``a = round(total x train)``, ``b = round(total x (train + val))`` (the test split
    takes the rest). A split may be empty; callers that need rows say so."""
    tr, va, _ = fractions
    a = int(round(total * tr))
    b = int(round(total * (tr + va)))
    return {"train": (0, a), "val": (a, b), "test": (b, total), "all": (0, total)}


def tail_fractions(val: float, test: float) -> tuple[float, float, float]:
    """(train, val, test) fractions for a split given as its last two parts: the last ``test`` of the rows
    are the test split, the ``val`` before them validate, the rest train."""
    return (1.0 - val - test, val, test)
