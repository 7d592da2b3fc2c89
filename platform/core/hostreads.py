"""Host-read audit: which training steps read a tensor back to the host (a device sync on a GPU).

`HostReadAudit` is a ``torch.overrides.TorchFunctionMode`` that the `Trainer` enters around each step's
compute and bookkeeping (not around fetching the batch) when ``MARIANA_AUDIT_HOST_READS=DIR`` is set (what
it counts and writes: platform/README.md, Host-read audit). It counts only on tensors made inside the current
step, so host-side sizes from the loader may be read freely; `violations(DIR)` lists the steps that read
although they are no log / eval / checkpoint step.
"""

from __future__ import annotations

import json
import os
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

ENV = "MARIANA_AUDIT_HOST_READS"

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}
DYNAMIC = {"unique", "unique_consecutive", "nonzero", "masked_select", "argwhere", "nonzero_static"}


def _tensors(x: Any):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, list | tuple):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


class HostReadAudit(TorchFunctionMode):
    """Counts host reads of tensors made since `begin` (see the module docstring). One per process."""

    def __init__(self, folder: str | Path, rank: int = 0):
        super().__init__()
        self.path = Path(folder) / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.made: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.reads: Counter = Counter()
        self.where: list[str] = []

    def begin(self) -> None:
        """A new step: forget earlier tensors and counts."""
        self.made = WeakIdKeyDictionary()
        self.reads, self.where = Counter(), []

    def end(self, step: int, log: bool, eval: bool, ckpt: bool) -> None:
        """Append the step's record (``log``/``eval``/``ckpt``: the step may read, it shows values)."""
        rec = {"step": step, "log": log, "eval": eval, "ckpt": ckpt, "reads": dict(self.reads)}
        rec["where"] = self.where
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _count(self, name: str) -> None:
        self.reads[name] += 1
        if len(self.where) < 5:  # the innermost call site outside torch
            frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename]
            if frames:
                self.where.append(f"{name} at {frames[-1].filename}:{frames[-1].lineno}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first in self.made:
            if name in READS or name in DYNAMIC:
                self._count(name)
            elif name == "where" and len(args) == 1 and not kwargs:
                self._count("where")
            elif name == "__getitem__" and any(
                t.dtype == torch.bool and t.dim() > 0 for t in _tensors(args[1:])
            ):
                self._count("bool_mask_index")
        elif name in DYNAMIC and any(t in self.made for t in _tensors(args)):
            self._count(name)
        out = func(*args, **kwargs)
        inputs = {id(t) for t in _tensors(args)} | {id(t) for t in _tensors(kwargs)}
        for t in _tensors(out):
            if id(t) not in inputs:  # `.to(same device)` returns its input: not made here
                self.made[t] = True
        return out


def from_env(rank: int) -> HostReadAudit | None:
    """The audit of ``MARIANA_AUDIT_HOST_READS=DIR``, or None when it is not set."""
    folder = os.environ.get(ENV, "")
    return HostReadAudit(folder, rank) if folder else None


def records(folder: str | Path) -> list[dict]:
    """Every rank's step records in ``folder`` (each with ``rank``)."""
    out = []
    for p in sorted(Path(folder).glob("rank*.jsonl")):
        rank = int(p.stem[4:])
        out += [{**json.loads(line), "rank": rank} for line in p.read_text().splitlines() if line]
    return out


def violations(folder: str | Path) -> list[dict]:
    """The records of steps that read the device back although they log, evaluate and checkpoint nothing."""
    return [r for r in records(folder) if r["reads"] and not (r["log"] or r["eval"] or r["ckpt"])]
