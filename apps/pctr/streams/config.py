"""Typed configuration of `mariana pctr stream`: the model, table, ids, optimiser and server sections of
``pctr train`` (`..configs`) plus the stream's own; no split, epochs, early stopping or schedule, which a
stream does not have (their flags do not exist). Standard library only."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import ClassVar

from mariana.platform.core.config import Section, TrainJob, at_least, at_least_one, non_negative, only, opt
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.tracking import TrackingSection

from ..configs import (
    DATA_FILES,
    PRESETS,
    RESUME_MAY_CHANGE,
    DenseOptim,
    Ids,
    Net,
    PctrConfig,
    PctrMethods,
    PctrRun,
    StreamPS,
    Table,
    Warm,
)


def parse_export_every(text: str) -> tuple[str, float]:
    """``"3"`` -> ("files", 3); ``"30s"`` -> ("seconds", 30.0). MarianaError for anything else."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s?)\s*", str(text))
    if m and m.group(2) == "s" and float(m.group(1)) >= 0:
        return "seconds", float(m.group(1))
    if m and not m.group(2) and "." not in m.group(1) and int(m.group(1)) >= 1:
        return "files", float(int(m.group(1)))
    raise MarianaError(
        f"--export-every must be a number of files >= 1 (e.g. 1) or seconds (e.g. 30s), got {text!r}"
    )


@dataclass
class StreamData(Section):
    """The folder the stream follows and its files' format."""

    NAME: ClassVar[str] = "input"
    TITLE: ClassVar[str] = "the followed folder"

    data: str = opt(
        "",
        "folder to follow: complete files (renamed into place; names starting with . or _ or ending in "
        ".tmp/.part are ignored) and partition subfolders holding a _SUCCESS marker",
        path=True,
    )
    files: str = opt(
        DATA_FILES,
        "comma-separated name patterns (fnmatch) of the files in --data that are data; other files (a "
        "README) are left alone; partition subfolders with a _SUCCESS marker are read whole",
    )
    format: str = opt("libfm", "input format of the files", ["criteo", "libfm"])
    num_fields: int = opt(
        0, "libFM: features per row (0: infer from the first file)", applies=only("format", "libfm")
    )
    prefetch: int = opt(2, "batches parsed ahead of the training step by a background thread (0: no thread)")

    def validate(self) -> None:
        non_negative(self, ("num_fields", "prefetch"))


@dataclass
class Follow(Section):
    """When the stream exports, how it polls, and when it stops."""

    NAME: ClassVar[str] = "stream"
    TITLE: ClassVar[str] = "following the folder: exports, polling, stopping"

    export_every: str = opt(
        "1",
        "export a new model version every N files (e.g. 1) or every S seconds (e.g. 30s) when the model "
        "changed; at the end too",
    )
    max_files: int = opt(0, "stop once the run has consumed this many files in total (0: never)")
    idle_exit: float = opt(0.0, "stop after this many seconds without a new file (0: never)")
    poll: float = opt(1.0, "seconds between scans of --data for new files")
    log_every: int = opt(10, "optimizer steps between metrics.jsonl records")

    def validate(self) -> None:
        parse_export_every(self.export_every)
        non_negative(self, ("max_files",))
        if not (math.isfinite(self.idle_exit) and self.idle_exit >= 0):
            raise MarianaError(f"--idle-exit must be seconds >= 0, got {self.idle_exit}")
        if not (math.isfinite(self.poll) and self.poll > 0):
            raise MarianaError(f"--poll must be seconds > 0, got {self.poll}")
        at_least_one(self, ("log_every",))


@dataclass
class StreamServers(StreamPS):
    # a parameter-server stream of libFM files needs --num-fields (`StreamConfig.check`)
    APPLIES: ClassVar[tuple] = (at_least("servers", 1, num_fields=10),)

    servers: int = opt(
        0,
        "parameter-server processes; 0 streams in this one process; >= 1: S servers + --workers W "
        "processes (streams/servers.py)",
    )


STREAM_SECTIONS = (PctrRun, StreamData, Net, Table, Ids, DenseOptim, Follow, StreamServers, Warm)


class StreamConfig(PctrMethods, TrainJob, sections=(*STREAM_SECTIONS, TrackingSection)):
    """``mariana pctr stream``. The class constants below are what a stream fixes (the shared trainer and
    step read them): every row of a file is trained on once, in file order, at constant learning rates,
    scored before (progressive validation), checkpointed after every file."""

    RESUME_MAY_CHANGE: ClassVar[frozenset[str]] = RESUME_MAY_CHANGE | {
        "files",
        "prefetch",
        "pull_ahead",
        "init_row_state",
        "init_train_state",
        "compile",
        "compile_backend",
        "export_every",
        "max_files",
        "idle_exit",
        "poll",
    }
    split: ClassVar[str] = "0.8,0.1,0.1"  # not used: the stream reads whole files
    epochs: ClassVar[int] = 30
    max_steps: ClassVar[int] = 0
    eval_every: ClassVar[int] = -1
    early_stop: ClassVar[int] = 2
    monitor: ClassVar[str] = ""
    val_rows: ClassVar[int] = 0
    shuffle: ClassVar[bool] = True
    ckpt_every: ClassVar[int] = 0
    schedule: ClassVar[str] = "constant"
    warmup_steps: ClassVar[int] = 0

    def check(self) -> None:
        super().check()
        if self.servers > 0:  # what a parameter-server stream (servers.py) cannot do
            if self.init_from:
                raise MarianaError(
                    "--init-from is not supported by `pctr stream --servers >= 1` yet; use --servers 0"
                )
            if self.ids != "hash":
                raise MarianaError("--ids dynamic is not supported with --servers >= 1; use --ids hash")
            if self.format == "libfm" and self.num_fields <= 0:
                raise MarianaError(
                    "`pctr stream --servers >= 1` with --format libfm needs --num-fields (every process builds "
                    "the model before the first file arrives)"
                )


def stream_preset(p: PctrConfig) -> StreamConfig:
    """A `pctr train` preset as a stream preset: its values of the fields a stream has, the stream's
    defaults for the others."""
    names = {f.name for f in dataclasses.fields(StreamConfig)} - {"data"}
    return StreamConfig(**{k: getattr(p, k) for k in names & {f.name for f in dataclasses.fields(p)}})


STREAM_PRESETS = {name: stream_preset(p) for name, p in PRESETS.items()}
