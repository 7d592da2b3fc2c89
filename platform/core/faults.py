"""Fault injection for the fault-tolerance tests (real faults in real processes).

``MARIANA_FAULT`` holds comma-separated ``kind:rank=R:step=S`` entries, e.g. ``kill:rank=1:step=5``:
- ``kill``: the process SIGKILLs itself before optimizer step S (first attempt only, so a restarted
  worker group can finish);
- ``hang``: the process stops participating (sleeps forever) before step S (first attempt only);
- ``raise``: the process raises ``ValueError`` (a bug, not bad input) before step S (first attempt only).
Unset in normal use; checked once per step with a dict lookup.
"""

from __future__ import annotations

import os
import signal
import time


def _parse(spec: str) -> dict[int, str]:
    out = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        kind, *kv = entry.split(":")
        d = dict(x.split("=") for x in kv)
        out_rank = int(d.get("rank", 0))
        if int(os.environ.get("RANK", "0")) == out_rank:
            out[int(d["step"])] = kind
    return out


class FaultInjector:
    def __init__(self):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        spec = os.environ.get("MARIANA_FAULT", "")
        self.at = _parse(spec) if (spec and first_attempt) else {}

    def maybe_fire(self, step: int) -> None:
        kind = self.at.get(step)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "raise":
            raise ValueError(f"injected fault before step {step}")
        elif kind == "hang":
            while True:  # stop participating; the watchdog on every rank must notice
                time.sleep(1)
