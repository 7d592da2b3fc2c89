"""What a job asks of the machines it runs on: ``mariana submit --nodes N --tasks-per-node K
--gpus-per-node G --cpus-per-task C --time T --partition P``, stored with the job (``jobs.resources``).

``normalize`` checks a request's resources (a dict from the REST API) and returns them with the defaults
left out, so a job that asked for nothing stores ``{}``. The executor decides whether it can honour them:
the local executor refuses anything beyond one task on this host, Slurm passes them to ``sbatch``.
"""

from __future__ import annotations

import re

from mariana.platform.core.errors import MarianaError

INT_FIELDS = {  # field -> (minimum, default)
    "nodes": (1, 1),
    "tasks_per_node": (1, 1),
    "gpus_per_node": (0, 0),
    "cpus_per_task": (1, None),
}
# Slurm's time formats: MIN, MIN:SEC, H:MIN:SEC, D-H, D-H:MIN, D-H:MIN:SEC.
TIME_RE = re.compile(r"^(\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2})$")
PARTITION_RE = re.compile(r"^[A-Za-z0-9_.,-]+$")


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def normalize(resources: dict | None) -> dict:
    """Checked resources without defaults (``{}`` for a job that asks for nothing special);
    MarianaError naming the field otherwise."""
    out: dict = {}
    for key, value in (resources or {}).items():
        if value is None:
            continue
        if key in INT_FIELDS:
            low, default = INT_FIELDS[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise MarianaError(f"{flag(key)} {value!r}: expected an integer >= {low}")
            if value != default:
                out[key] = value
        elif key == "time":
            if not isinstance(value, str) or not TIME_RE.match(value):
                raise MarianaError(
                    f"--time {value!r}: expected minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]] (Slurm's formats)"
                )
            out[key] = value
        elif key == "partition":
            if not isinstance(value, str) or not PARTITION_RE.match(value):
                raise MarianaError(f"--partition {value!r}: expected a Slurm partition name")
            out[key] = value
        else:
            expected = ", ".join(sorted([*INT_FIELDS, "time", "partition"]))
            raise MarianaError(f"resources: unknown field {key!r} (expected {expected})")
    return out


def tasks(resources: dict) -> int:
    """How many agents the job runs (one torchrun agent per task): nodes x tasks per node."""
    return resources.get("nodes", 1) * resources.get("tasks_per_node", 1)


def describe(resources: dict) -> str:
    """``--nodes 2 --gpus-per-node 4`` for messages (empty for the defaults)."""
    return " ".join(f"{flag(k)} {v}" for k, v in resources.items())
