"""The run directory every command writes (layout: platform/README.md, The run directory)."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from . import jsonfile
from .atomic import atomic_write_text
from .config import read_config_values, save_config
from .errors import MarianaError


class RunDir:
    def __init__(self, path: str | Path, create: bool = True):
        self.path = Path(path)
        self.ckpt_dir = self.path / "checkpoints"
        self.log_dir = self.path / "logs"
        self.config_path = self.path / "config.toml"
        self.metrics_jsonl = self.path / "metrics.jsonl"
        self.tracker = None  # rank 0's MLflow/TensorBoard `tracking.Tracker`, when the run has one
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
            f.write(jsonfile.dumps(record) + "\n")
        if self.tracker is not None:
            self.tracker.log(record)

    def drop_metrics_after(self, step: int) -> int:
        """Remove the ``metrics.jsonl`` records of steps after ``step`` (a resume redoes those steps from the
        checkpoint at ``step``; kept, they would repeat steps and curves would double back). Records without
        a step and lines that are not JSON stay. Returns how many records went; rewrites the file atomically."""
        if not self.metrics_jsonl.is_file():
            return 0
        keep, dropped = [], 0
        for line in self.metrics_jsonl.read_text().splitlines(keepends=True):
            try:
                s = json.loads(line).get("step")
            except (ValueError, AttributeError):
                s = None
            if isinstance(s, int | float) and s > step:
                dropped += 1
            else:
                keep.append(line)
        if dropped:
            atomic_write_text(self.metrics_jsonl, "".join(keep))
        return dropped

    def write_final(self, metrics: dict[str, Any], name: str = "metrics.json") -> None:
        atomic_write_text(self.path / name, jsonfile.dumps(metrics, indent=2, sort_keys=True) + "\n")
        if self.tracker is not None and name == "metrics.json":
            self.tracker.final(metrics)  # the exported model is written by now


def eval_result_path(run_dir: str | Path, data: str | Path, split: str = "") -> Path:
    """Where ``mariana <app> eval`` writes its result for one data set: ``RUN/eval/<name>[-<split>].json``.

    ``<name>`` is the data path's last component (a file's name without its extension, or a folder's
    name) reduced to ``[A-Za-z0-9._-]``, so evaluating several data sets keeps one file each instead of
    overwriting one ``eval.json``. ``split`` ("", "all", "train", "val", "test") is appended unless empty
    or ``all``."""
    import re

    p = Path(str(data).rstrip("/"))
    name = p.stem if p.suffix and not p.is_dir() else p.name
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "data"
    if split and split != "all":
        name = f"{name}-{split}"
    return Path(run_dir) / "eval" / f"{name}.json"


def write_eval_result(result: dict, run_dir: str | Path, data: str | Path, split: str = "", out=None) -> Path:
    """Write ``result`` (JSON, atomically) to ``out``, default `eval_result_path` (run_dir, data, split);
    -> the path written."""
    out = Path(out) if out is not None else eval_result_path(run_dir, data, split)
    out.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(out, jsonfile.dumps(result, indent=2) + "\n")


def resume_differences(cfg: Any, saved: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(field, saved value, new value)`` for every field of ``cfg`` outside its class's
    ``RESUME_MAY_CHANGE`` whose value differs from ``saved`` (a run's config.toml as a dict; a field
    missing there counts as None). Path fields are compared as absolute paths; a field that does not apply
    under ``cfg`` (`Config.applies`: unused, and left out of config.toml) is not compared."""
    import dataclasses
    import os

    allowed = getattr(type(cfg), "RESUME_MAY_CHANGE", frozenset())
    diffs = []
    for f in dataclasses.fields(cfg):
        if f.name in allowed or not (cfg.applies(f.name) if hasattr(cfg, "applies") else True):
            continue
        new, old = getattr(cfg, f.name), saved.get(f.name)
        if f.metadata.get("path") and isinstance(old, str) and old:
            old = os.path.abspath(old)
        if isinstance(new, float) and isinstance(old, int | float) and not isinstance(old, bool):
            old = float(old)
        if isinstance(new, tuple):
            new = list(new)
        if new != old:
            diffs.append((f.name, old, new))
    return sorted(diffs, key=lambda d: d[0])  # by name: the order of fields follows their sections


def check_resume_config(cfg: Any, run_dir: str | Path) -> None:
    """Refuse a ``--resume`` whose settings differ from the checkpoint's ``RUN/config.toml`` in a field that
    changes the model, the data order or restored optimizer state (`MarianaError` listing
    ``field: saved -> new``). A run without config.toml is not checked."""
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        return
    diffs = resume_differences(cfg, read_config_values(path))
    if diffs:
        pairs = ", ".join(f"{name}: {old!r} -> {new!r}" for name, old, new in diffs)
        allowed = ", ".join(sorted(getattr(type(cfg), "RESUME_MAY_CHANGE", ())))
        raise MarianaError(
            f"--resume: these settings differ from the run's {path}: {pairs}; resume with the saved values "
            f"or start a new --out (fields that may change on resume: {allowed})"
        )


def setup_logging(run: RunDir | None, rank: int = 0, verbose: bool = False) -> logging.Logger:
    """Logger ``mariana``: every rank writes RUN/logs/rank-R.log (DEBUG and up); rank 0 also prints INFO
    and up to stderr (DEBUG too when ``verbose``). Routine events (checkpoints) are DEBUG: file only."""
    log = logging.getLogger("mariana")
    log.setLevel(logging.DEBUG)
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
        sh.setLevel(logging.DEBUG if verbose else logging.INFO)
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
        if getattr(cfg, "resume", False):  # also when torchrun was started by hand, not by our launcher
            check_resume_config(cfg, run.path)
        run.save_config(cfg)
    torch.manual_seed(cfg.seed)
    return run, log
