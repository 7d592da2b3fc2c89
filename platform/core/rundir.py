"""The run directory every command writes.

Layout::

    RUN/config.toml        resolved config (defaults < preset < TOML < flags)
    RUN/checkpoints/       step_XXXXXXXX/{state.pt, rng-rankR.pt} + `latest` (name of the newest complete one)
    RUN/metrics.jsonl      one JSON object per logged step (step, loss, samples_per_s, step_time_s, comm_time_s, lr)
    RUN/metrics.json       final metrics of the run
    RUN/logs/              rank-R.log per process, stall reports from the watchdog
    RUN/model.safetensors  exported weights + RUN/model.json (config and metadata), see `export.py`
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from .atomic import atomic_write_text
from .config import save_config


class RunDir:
    def __init__(self, path: str | Path, create: bool = True):
        self.path = Path(path)
        self.ckpt_dir = self.path / "checkpoints"
        self.log_dir = self.path / "logs"
        self.config_path = self.path / "config.toml"
        self.metrics_jsonl = self.path / "metrics.jsonl"
        self.metrics_json = self.path / "metrics.json"
        if create:
            for d in (self.path, self.ckpt_dir, self.log_dir):
                d.mkdir(parents=True, exist_ok=True)

    def has_checkpoint(self) -> bool:
        return (self.ckpt_dir / "latest").is_file()

    def save_config(self, cfg: Any) -> None:
        save_config(cfg, self.config_path)

    def log_metrics(self, record: dict[str, Any]) -> None:
        """Append one JSON line (rank 0 only). Flushed at once so a live viewer / a crash keeps it."""
        record = {"time": round(time.time(), 3), **record}
        with open(self.metrics_jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_jsonl.is_file():
            return []
        return [json.loads(line) for line in self.metrics_jsonl.read_text().splitlines() if line.strip()]

    def write_final(self, metrics: dict[str, Any], name: str = "metrics.json") -> None:
        atomic_write_text(self.path / name, json.dumps(metrics, indent=2, sort_keys=True) + "\n")


def setup_logging(run: RunDir | None, rank: int = 0, verbose: bool = False) -> logging.Logger:
    """Logger ``mariana``: every rank writes RUN/logs/rank-R.log; rank 0 also prints to stderr."""
    log = logging.getLogger("mariana")
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S")
    if run is not None:
        fh = logging.FileHandler(run.log_dir / f"rank-{rank}.log")
        fh.setFormatter(fmt)
        log.addHandler(fh)
    if rank == 0:
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(fmt)
        log.addHandler(sh)
    return log


def start_run(cfg: Any, rank: int = 0, is_main: bool = True) -> tuple[RunDir, logging.Logger]:
    """The prologue of every training job: open ``cfg.out`` as a run directory, set up this rank's
    logging, save the resolved config (main rank only) and seed torch with ``cfg.seed``."""
    import torch

    run = RunDir(cfg.out)
    log = setup_logging(run, rank)
    if is_main:
        run.save_config(cfg)
    torch.manual_seed(cfg.seed)
    return run, log
