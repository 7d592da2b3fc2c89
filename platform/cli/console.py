"""Console lines shared by every app, so that the same event reads the same everywhere.

`progress`: what a long step shows while it works (a bar on a terminal, periodic lines in a log);
`warn_skipped`: the one warning for input a command left out (malformed libFM/Criteo lines of pCTR and
mlp, corrupt images of vision, unreadable recordings of ASR)::

    mariana: warning: skipped 3 malformed lines in data.libfm (first: line 7: expected 'label id:value ...')

Standard library only (the CLI modules import it before torch)."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping

from ..runtime.workerio import PROGRESS_EVERY_ENV


def first_example(examples: Mapping | Iterable | None) -> str:
    """The first of ``examples`` as ``"WHERE: why"``: a mapping ``{line number: why}`` (keys as ints or
    digit strings; the smallest line is first) gives ``"line K: why"`` unless ``why`` already starts with
    its own ``"FILE line L: "`` (several input files); pairs ``(where, why)`` (a path, a recording) give
    ``"where: why"``; a bare string is taken as is. '' when there is none."""
    if not examples:
        return ""
    if isinstance(examples, str):
        return examples
    if isinstance(examples, Mapping):
        k, why = min(examples.items(), key=lambda kv: int(kv[0]))
        why = str(why)
        return why if " line " in why.split(":")[0] else f"line {k}: {why}"
    where, why = next(iter(examples))
    return f"{where}: {why}"


def skipped_line(data, count: int, examples=None, what: str = "malformed line") -> str:
    """``"skipped N WHATs in DATA (first: WHERE: why)"`` (``what`` singular; an ``s`` is added for N != 1;
    the parenthesis is left out when ``examples`` is empty)."""
    first = first_example(examples)
    tail = f" (first: {first})" if first else ""
    return f"skipped {count} {what}{'s' * (count != 1)} in {data}{tail}"


def warn_skipped(
    data, count, examples=None, what: str = "malformed line", log: logging.Logger | None = None
) -> None:
    """Say once that ``count`` input units of ``data`` were skipped (nothing when ``count`` is 0/None):
    ``mariana: warning: <skipped_line>`` on stderr. With ``log`` (code running inside a training process)
    the line also goes to the run's log, and only rank 0 (torchrun's ``RANK``) prints it, so a
    multi-worker run says it once, in the same words as a one-process command."""
    count = int(count or 0)
    if not count:
        return
    line = skipped_line(data, count, examples, what)
    if log is not None:
        log.debug(line)
    if log is None or os.environ.get("RANK", "0") == "0":
        print(f"mariana: warning: {line}", file=sys.stderr, flush=True)


def progress(items: Iterable, total: int, desc: str, units: str = "batches") -> Iterator:
    """Yield ``items`` while showing how far a long step is, on stderr of rank 0 only: a tqdm bar on a
    terminal; elsewhere (a log, the job service) a line ``mariana: DESC: K/TOTAL UNITS (P %)`` at most every
    ``$MARIANA_PROGRESS_EVERY`` seconds (30)."""
    quiet = os.environ.get("RANK", "0") != "0"
    if quiet or sys.stderr.isatty():
        from tqdm import tqdm

        yield from tqdm(items, desc=desc, total=total, unit=units, leave=False, disable=quiet)
        return
    last, every = time.monotonic(), float(os.environ.get(PROGRESS_EVERY_ENV) or 30)
    for done, item in enumerate(items, 1):
        yield item
        if time.monotonic() - last >= every:
            last, share = time.monotonic(), f"{done}/{total} {units} ({100 * done // total} %)"
            print(f"mariana: {desc}: {share}", file=sys.stderr, flush=True)
