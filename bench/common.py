"""Shared bits of the benchmarks: machine/version record and result writing."""

from __future__ import annotations

import datetime
import json
import os
import platform as _platform  # noqa: I001  (the standard library module, not mariana.platform)
import shlex
import subprocess
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def commit() -> str:
    """The code's commit: ``$MARIANA_COMMIT`` (a copy of the tree without .git, e.g. on a GPU machine), else
    git's short HEAD (with ``+dirty`` when tracked files differ), else "unknown"."""
    if os.environ.get("MARIANA_COMMIT"):
        return os.environ["MARIANA_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=10)  # noqa: E731
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode:
            return "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def machine() -> dict:
    info = {
        "host": _platform.node(),
        "cpu_count": os.cpu_count(),
        "processor": _platform.processor() or _platform.machine(),
        "python": _platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import torchvision

        info["torchvision"] = torchvision.__version__
    except ImportError:
        pass
    return info


def write_result(name: str, payload: dict) -> Path:
    """Write ``bench/results/NAME-{cpu,gpu}.json``: the machine record (with the commit) and the command
    line (for the README's tables, `bench/report.py`), then ``payload``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "gpu" if torch.cuda.is_available() else "cpu"
    path = RESULTS / f"{name}-{tag}.json"
    record = {"machine": machine(), "command": shlex.join(["python", *sys.argv])}
    record.update(payload)  # a bench that records its own command keeps it
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def table(rows: list[dict], cols: list[str]) -> str:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    line = lambda vals: "  ".join(str(v).rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join(
        [line(cols), line(["-" * w for w in widths]), *(line([r.get(c, "") for c in cols]) for r in rows)]
    )


def median_round(results: list[dict], key: str) -> dict:
    """Of repeated runs of one loop, the run whose ``key`` is the median (the lower middle of an even
    count), with ``rounds``: every run's ``key`` in the order they ran."""
    mid = sorted(results, key=lambda r: r[key])[(len(results) - 1) // 2]
    return {**mid, "rounds": [r[key] for r in results]}


@torch.no_grad()
def init_like_ours(weight: torch.Tensor, std: float = 0.01) -> None:
    """The table as ours starts (`ps.shard.init_rows`): embeddings N(0, 0.01), linear weights 0.
    ``nn.EmbeddingBag``'s own N(0, 1) saturates the FM term, and the tiny gradients that follow are
    subnormal floats, which make the fp32 matrix products 4-8x slower on x86: a baseline slowed by its
    initialisation, not by its work."""
    weight.normal_(0.0, std)
    weight[:, 0] = 0.0
