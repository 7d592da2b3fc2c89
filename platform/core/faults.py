"""Fault injection for the fault-tolerance tests (real faults in real processes), for every framework.

``MARIANA_FAULT`` holds comma-separated entries ``KIND:WHO=I:WHEN=N``:

- ``KIND``: ``kill`` (the process SIGKILLs itself), ``raise`` (it raises ``ValueError``: a bug, not bad
  input) or ``hang`` (it stops participating: sleeps forever, for the watchdog to notice).
- ``WHO=I``: which process. ``rank=R``: the process of global rank R (the default, ``rank=0``, when an
  entry names none); in a parameter-server job also ``worker=W`` (the W-th worker) and ``server=S`` (the
  S-th server), the roles the job registered with `set_role`.
- ``WHEN=N``: ``step=N`` fires before the process's N-th training step (1-based: ``step=8`` after 7
  steps; the `Trainer` checks it, so it works on data-parallel ranks and parameter-server workers alike);
  ``push=N`` fires when a parameter server receives its N-th push.

Every entry fires on the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), so a restarted group can
finish. Examples::

    MARIANA_FAULT=kill:rank=1:step=5            data-parallel rank 1 dies before step 5
    MARIANA_FAULT=hang:rank=1:step=4            rank 1 stalls before step 4
    MARIANA_FAULT=raise:rank=1:step=3           rank 1 raises ValueError before step 3
    MARIANA_FAULT=kill:worker=1:step=15         parameter-server worker 1 dies before its step 15
    MARIANA_FAULT=kill:server=1:push=30         parameter server 1 dies at its 30th push

A malformed entry raises ``ValueError`` naming it (a typo must not silently test nothing). Unset in normal
use; checked with one dict lookup per step or push.

Injection points: each holds a `FaultInjector` read from ``MARIANA_FAULT`` when it is built and calls
``maybe_fire(n)`` at its event; nothing replaces their methods at run time.

- `mariana.platform.core.loop.Trainer`: ``step`` events, before each optimizer step (``n``: the 1-based
  step about to run), in `Trainer.fit` and `Trainer.train_now`;
- `mariana.platform.ps.server.ParamServer`: ``push`` events, before the server applies its ``n``-th push
  (replays included).
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
