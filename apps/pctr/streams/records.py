"""`StreamRecords`: what a `pctr stream` keeps about itself besides the model: when to export (and the
export, `train.export`), its checkpoints with the consumed-file ledger, its counters and ``metrics.json``
record. A base class of `streamer.Streamer`; it reads the stream's state (``ledger``, ``totals``, ``version``,
``dirty``, ``since_export``, ``last_export``, ``export_kind``/``export_n``, ``step``, ``run``, ``setup``)
and calls its ``_model()`` and ``_write_metrics()``."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from mariana.platform.core.checkpoint import load_checkpoint, save_checkpoint, set_rng_state
from mariana.platform.core.errors import MarianaError
from mariana.platform.ps.pull import counter_path, write_counter

from ..train import export

log = logging.getLogger("mariana")


class StreamRecords:
    """Exports, checkpoints, counters of a stream (module docstring)."""

    def export_due(self) -> bool:
        if not self.dirty:
            return False
        if self.export_kind == "files":
            return len(self.since_export) >= self.export_n
        return time.monotonic() - self.last_export >= self.export_n

    def maybe_export(self, force: bool = False) -> bool:
        if not (self.export_due() or (force and self.dirty)):
            return False
        self.export()
        return True

    def export(self) -> None:
        """The normal pCTR export (`train.export`, atomic files, a new version digest) of the current model."""
        model, table, seen = self._model()
        last = self.ledger[-1] if self.ledger else {}
        metrics = {
            "files": self.totals["files"],
            "rows": self.totals["rows"],
            "step": self.totals["steps"],
            "last_file": last.get("name", ""),
            "progressive_auc": last.get("auc", float("nan")),
            "progressive_logloss": last.get("logloss", float("nan")),
        }
        export(self.run, self.setup, model, table, seen, {"metrics": metrics})
        now = time.time()
        self.version = json.loads((self.run.path / "model.json").read_text())["version"]
        for e in self.since_export:
            e["export_lag_s"] = round(now - e["landed"], 3)
            e["version"] = self.version
        self.totals["exports"] += 1
        self.since_export, self.dirty, self.last_export = [], False, time.monotonic()

    def checkpoint(self) -> None:
        """Atomic checkpoint numbered by files consumed: the step's state (model, dense optimiser, row
        optimiser state and ``seen``), the ledger, the totals, the RNG states (`save_checkpoint`)."""
        n = self.totals["files"]
        folder = self.run.ckpt_dir / f"step_{n:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        state = {**self.step.checkpoint_state(folder), "stream": self._saved_records()}
        save_checkpoint(self.run, n, state, 0, lambda: None)
        self._write_metrics()

    def _restore(self) -> None:
        state, rng = load_checkpoint(self.run)
        folder = self.run.ckpt_dir / (self.run.ckpt_dir / "latest").read_text().strip()
        if "stream" not in state:
            raise MarianaError(
                f"checkpoint {folder} is not a `pctr stream` checkpoint (no consumed-file ledger)"
            )
        self.step.restore(state, folder)
        if rng is not None:
            set_rng_state(rng)
        self._load_records(state["stream"], folder.name)

    def _start_records(self) -> None:
        """A fresh stream's records: nothing consumed, exported or changed yet."""
        self.ledger: list[dict[str, Any]] = []
        self.totals = {"files": 0, "rows": 0, "skipped_lines": 0, "steps": 0, "exports": 0}
        self.version, self.dirty = "", False  # dirty: trained since the last export
        self.since_export: list[dict[str, Any]] = []  # ledger entries trained on since the last export
        self.last_export = time.monotonic()
        self.changed: set[str] = set()

    def _saved_records(self) -> dict[str, Any]:
        """The records a checkpoint keeps (JSON-able; `_load_records` reads them back)."""
        since = [e["name"] for e in self.since_export]
        return {
            "ledger": self.ledger,
            "totals": self.totals,
            "version": self.version,
            "dirty": self.dirty,
            "since_export": since,
        }

    def _load_records(self, s: dict[str, Any], checkpoint: str) -> None:
        """The records ``s`` saved in the checkpoint named ``checkpoint`` (ledger, totals, export state)."""
        self.ledger = [dict(e) for e in s["ledger"]]
        self.totals.update(s["totals"])
        self.version, self.dirty = str(s["version"]), bool(s["dirty"])
        names = set(s["since_export"])
        self.since_export = [e for e in self.ledger if e["name"] in names]
        log.info(
            "resumed from %s: %d files consumed (%d rows), model version %s",
            checkpoint,
            self.totals["files"],
            self.totals["rows"],
            self.version or "not exported yet",
        )
        self._recover_counter()

    def _file_record(self, entry: dict[str, Any]) -> dict[str, Any]:
        """The counters record of the file of ledger ``entry``, the last consumed (totals as they are now)."""
        return {
            "file": entry["name"],
            "files": self.totals["files"],
            "rows": self.totals["rows"],
            "file_rows": entry["rows"],
            "skipped_lines": self.totals["skipped_lines"],
            "progressive_auc": entry["auc"],
            "progressive_logloss": entry["logloss"],
            **{k: entry[k] for k in ("read_s", "score_s", "fit_s", "train_s", "train_lag_s")},
        }

    def _recover_counter(self) -> None:
        """A stream stopped between a file's checkpoint and its counters record resumes with that file
        consumed and no record of it: the record is written now from the ledger (marked ``recovered``), so
        the counters hold one record per consumed file. A half-written last line (a stop mid-write) is dropped."""
        path = counter_path(self.run, 0)
        text = path.read_text() if path.exists() else ""
        done = text[: text.rfind("\n") + 1]
        if done != text:
            path.write_text(done)
        recorded = sum("file" in json.loads(x) for x in done.splitlines())
        if self.ledger and recorded == len(self.ledger) - 1:
            self._counters(
                {
                    **self._file_record(self.ledger[-1]),
                    "step": self.totals["steps"],
                    "recovered": True,
                    **({"version": self.version} if self.version and not self.dirty else {}),
                }
            )

    def _counters(self, rec: dict[str, Any]) -> None:
        write_counter(self.run, 0, {"time": round(time.time(), 3), **rec})
        self.run.log_metrics(rec)

    def _final_record(self, mode: str, **extra) -> dict[str, Any]:
        """metrics.json of a stream: the totals, the layout (``extra``) and the last file's scores."""
        last = self.ledger[-1] if self.ledger else {}
        return {
            **self.totals,
            "mode": mode,
            **extra,
            "version": self.version,
            "last_file": last.get("name", ""),
            "progressive_auc": last.get("auc", float("nan")),
            "progressive_logloss": last.get("logloss", float("nan")),
            "train_lag_s": last.get("train_lag_s", float("nan")),
            "changed_after_consume": len(self.changed),
        }
