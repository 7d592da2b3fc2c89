"""Fault injection for the fault-tolerance tests (real faults in real processes), for every framework.

``MARIANA_FAULT`` holds comma-separated entries ``KIND:WHO=I:WHEN=N`` (platform/README.md, Fault
injection): ``kill`` is SIGKILL, ``raise`` a ``ValueError`` (a bug, not bad input), ``hang`` sleeps forever
(for the watchdog); WHO defaults to ``rank=0``, roles come from `set_role`; ``step=N`` is 1-based.

Entries fire on the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), so a restarted group can
finish; a malformed entry raises ``ValueError`` naming it (a typo must not silently test nothing). Each
injection point (`mariana.platform.core.loop.Trainer`: ``step``; `mariana.platform.ps.server.ParamServer`:
``push``, replays included) holds a `FaultInjector` and calls ``maybe_fire(n)``: one dict lookup per event.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "MARIANA_FAULT"
KINDS = ("kill", "raise", "hang")
WHO = ("rank", "worker", "server")
WHEN = ("step", "push")

_roles: dict[str, int] = {}  # role -> index of this process besides its rank (see `set_role`)


def set_role(kind: str, index: int) -> None:
    """Name this process for ``MARIANA_FAULT`` besides its rank, e.g. ``set_role("worker", 1)``."""
    if kind not in WHO or kind == "rank":
        raise ValueError(f"fault role must be one of {', '.join(WHO[1:])}, got {kind!r}")
    _roles.clear()
    _roles[kind] = int(index)


def parse(spec: str) -> list[tuple[str, str, int, str, int]]:
    """``spec`` -> [(kind, who, index, when, n)]; raises ValueError on a malformed entry."""
    out = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        kind, *kv = entry.split(":")
        try:
            d = {k: int(v) for k, v in (x.split("=", 1) for x in kv)}
        except ValueError:
            raise ValueError(f"{ENV} entry {entry!r}: expected KIND:WHO=I:WHEN=N with integers") from None
        who = [k for k in d if k in WHO] or ["rank"]
        when = [k for k in d if k in WHEN]
        unknown = set(d) - set(WHO) - set(WHEN)
        if kind not in KINDS or len(who) != 1 or len(when) != 1 or unknown:
            raise ValueError(
                f"{ENV} entry {entry!r}: expected KIND:WHO=I:WHEN=N with KIND one of {', '.join(KINDS)}, "
                f"WHO one of {', '.join(WHO)}, WHEN one of {', '.join(WHEN)}"
            )
        out.append((kind, who[0], d.get(who[0], 0), when[0], d[when[0]]))
    return out


def _this_process() -> dict[str, int]:
    return {"rank": int(os.environ.get("RANK", "0")), **_roles}


class FaultInjector:
    """The faults of this process for one kind of event (``"step"`` or ``"push"``): ``at`` maps the
    1-based event number to the fault's kind."""

    def __init__(self, event: str = "step"):
        if event not in WHEN:
            raise ValueError(f"fault event must be one of {', '.join(WHEN)}, got {event!r}")
        self.event = event
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        spec = os.environ.get(ENV, "")
        me = _this_process()
        self.at: dict[int, str] = {}
        if spec and first_attempt:
            for kind, who, index, when, n in parse(spec):
                if when == event and me.get(who) == index:
                    self.at[n] = kind

    def maybe_fire(self, n: int) -> None:
        kind = self.at.get(n)
        if kind is None:
            return
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "raise":
            raise ValueError(f"injected fault before {self.event} {n}")
        elif kind == "hang":
            while True:  # stop participating; the watchdog on every rank must notice
                time.sleep(1)
