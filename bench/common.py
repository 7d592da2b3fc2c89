"""Shared bits of the benchmarks: machine/version record, result writing, the plain pCTR model."""

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
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"


def commit() -> str:
    """The code's commit: ``$MARIANA_COMMIT`` (a copy of the tree without .git, e.g. on a GPU machine), else
    git's short HEAD (with ``+dirty`` when tracked files outside bench/results differ), else "unknown"."""
    if os.environ.get("MARIANA_COMMIT"):
        return os.environ["MARIANA_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=10)  # noqa: E731
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode:
            return "unknown"
        # a bench's own result files (written part by part) do not make the sources dirty
        dirty = git(
            "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"
        ).stdout.strip()
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


class PlainDeepFM(nn.Module):
    """The plain PyTorch DeepFM the pCTR benchmarks compare with: one ``nn.EmbeddingBag(sum,
    sparse=True)`` over ``fields x R`` rows of ``1 + dim`` floats (column 0 the linear weight; started as
    ours, `init_like_ours`), FM, an MLP ``fields * dim + num_dense -> hidden... -> 1`` (ReLU) and, with
    dense features, a linear term on them.

    ``forward(ids [B, fields] int64, dense [B, num_dense] or None) -> logits [B]``; ``offsets``: ids are
    per field in ``[0, R)`` (field f's rows start at ``f R``), else already table rows. ``floor``: the rows
    are detached from the table (their gradient is computed, nothing reaches the table): the cost of
    every step of this model but the table's own work."""

    def __init__(
        self,
        fields: int,
        R: int,
        dim: int,
        hidden,
        num_dense: int = 0,
        *,
        offsets: bool = True,
        floor: bool = False,
    ):
        super().__init__()
        self.fields, self.dim, self.offsets, self.floor = fields, dim, offsets, floor
        self.emb = nn.EmbeddingBag(fields * R, 1 + dim, mode="sum", sparse=True)
        init_like_ours(self.emb.weight)
        self.register_buffer("base", torch.arange(fields) * R)
        sizes = [fields * dim + num_dense, *hidden]
        layers: list[nn.Module] = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.mlp, self.head = nn.Sequential(*layers), nn.Linear(sizes[-1], 1)
        self.dense_linear = nn.Linear(num_dense, 1) if num_dense else None

    def forward(self, ids: torch.Tensor, dense: torch.Tensor | None = None) -> torch.Tensor:
        rows = ids + self.base if self.offsets else ids
        rows = self.emb(rows.reshape(-1, 1)).view(ids.shape[0], self.fields, 1 + self.dim)
        if self.floor:
            rows = rows.detach().requires_grad_()
        lin, e = rows[..., 0].sum(1), rows[..., 1:]
        s = e.sum(1)
        fm = 0.5 * (s * s - (e * e).sum(1)).sum(1)
        x = e.flatten(1) if self.dense_linear is None else torch.cat([e.flatten(1), dense], 1)
        out = lin + fm + self.head(self.mlp(x)).squeeze(1)
        return out if self.dense_linear is None else out + self.dense_linear(dense).squeeze(1)
