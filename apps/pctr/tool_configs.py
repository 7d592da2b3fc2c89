"""Typed configuration of `mariana pctr eval` and `mariana pctr drift-logs` (standard library only)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from mariana.platform.core.config import Config, Section, at_least, opt

from .data.drift import DriftSettings


@dataclass
class EvalSection(Section):
    """What to score with which run."""

    NAME: ClassVar[str] = "eval"
    TITLE: ClassVar[str] = "the run and the data to score"

    model: str = opt("", "run directory of a finished `mariana pctr train`", required=True)
    data: str = opt(
        "",
        "Criteo TSV or libFM data to score: a file, a comma-separated list of files or a folder of "
        "partitions (its files in name order, without names starting with '.' or '_')",
        required=True,
    )
    format: str | None = opt(None, "data format (default: the model's)", ["criteo", "libfm"])
    split: str = opt(
        "all",
        "score only this row-order split of the file, cut with the fractions the run was trained with "
        "(its config.toml's split); a split the run does not have is refused",
        ["all", "train", "val", "test"],
    )
    device: str = opt("cpu", "cpu or cuda")


class PctrEvalConfig(Config, sections=(EvalSection,)):
    """``mariana pctr eval``."""


@dataclass
class DriftOutput(Section):
    """Where the day files go."""

    NAME: ClassVar[str] = "output"
    TITLE: ClassVar[str] = "output folder"

    out: str = opt("", "folder to write the day files into (created)", required=True)


NEW_DAYS = at_least("days", 2)  # what changes from one day to the next needs a second day


@dataclass
class DriftWorld(Section):
    """The generator's knobs (`data.drift.DriftSettings`, which checks them)."""

    NAME: ClassVar[str] = "world"
    TITLE: ClassVar[str] = "the simulated ads, users and click rates"

    days: int = opt(7, "days to write (DIR/day-01.tsv ...)")
    rows_per_day: int = opt(100_000, "impressions per day file")
    seed: int = opt(0, "random seed (same settings and seed -> the same bytes)")
    ads: int = opt(20_000, "ads alive on any day")
    new_ads: float = opt(
        0.25, "share of the alive ads replaced by newborn ads (new ids) each new day", applies=NEW_DAYS
    )
    new_users: float = opt(0.3, "share of each day's impressions from user ids never seen before")
    users: int = opt(100_000, "returning users available on day 1")
    segments: int = opt(32, "user segments (the segment x ad category affinity drives clicks)")
    categories: int = opt(24, "ad categories")
    sites: int = opt(5_000, "sites (publishers)")
    drift: float = opt(
        0.5,
        "day-to-day drift of the affinities and ad effects: x <- sqrt(1-a^2) x + a * fresh (0: fixed, 1: "
        "redrawn every day)",
        applies=NEW_DAYS,
    )
    affinity: float = opt(1.0, "std (logits) of the segment x category affinity")
    rank: int = opt(4, "latent taste dimensions behind the segment x category affinity")
    ad_effect: float = opt(0.8, "std (logits) of each ad's own effect")
    ctr: float = opt(0.12, "click rate of an average impression")

    def validate(self) -> None:
        self.settings().check()

    def settings(self) -> DriftSettings:
        """These knobs as the generator's settings."""
        return DriftSettings(**{f.name: getattr(self, f.name) for f in fields(DriftSettings)})


class DriftLogsConfig(Config, sections=(DriftOutput, DriftWorld)):
    """``mariana pctr drift-logs``."""


assert {f.name for f in fields(DriftWorld)} == {f.name for f in fields(DriftSettings)}, "drift knobs drifted"
