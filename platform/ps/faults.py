"""Fault injection for the parameter-server tests: real SIGKILLs of real processes.

``MARIANA_PS_FAULT`` holds comma-separated entries, each killing one process on its FIRST attempt only
(so the restarted job can finish):
- ``kill:worker=W:step=N``  worker W SIGKILLs itself before its training step N;
- ``kill:server=S:push=N``  server S SIGKILLs itself when it receives its N-th push.
Unset in normal use.
"""

from __future__ import annotations

import os
import signal


def _entries(kind: str, index: int, key: str) -> set[int]:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return set()
    out = set()
    for e in filter(None, (x.strip() for x in os.environ.get("MARIANA_PS_FAULT", "").split(","))):
        action, *kv = e.split(":")
        d = dict(x.split("=", 1) for x in kv)
        if action == "kill" and int(d.get(kind, -1)) == index and key in d:
            out.add(int(d[key]))
    return out


class Fault:
    def __init__(self, kind: str, index: int, key: str):
        self.at = _entries(kind, index, key)

    def maybe_fire(self, n: int) -> None:
        if n in self.at:
            os.kill(os.getpid(), signal.SIGKILL)
