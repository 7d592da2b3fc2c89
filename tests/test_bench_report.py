"""The README's measured tables are generated from `bench/results/*.json` (`bench/report.py`): the block in
README.md must be exactly what the report prints, so no number there can drift from its result file."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import report  # noqa: E402  (bench/ is scripts, not a package)


def _readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    start, stop = text.index(report.BEGIN), text.index(report.END) + len(report.END)
    return text[start:stop]


def test_readme_tables_are_the_reports_output():
    assert _readme_block() == report.tables(), (
        "README.md's bench block is stale: run python bench/report.py --write"
    )


def test_every_row_names_date_commit_and_command():
    for row in report.GPU_ROWS + report.CPU_ROWS:
        date, commit, command = report.provenance(report.load(row.file), row)
        assert len(date) == 10 and date[:2] == "20", row.file
        assert commit != "?", f"{row.file}: no commit (commit or recorded_in)"
        assert command, row.file


def test_a_changed_result_changes_the_table(tmp_path, monkeypatch):
    """Plant the fault: one result file re-measured without regenerating the README is caught."""
    results = tmp_path / "results"
    shutil.copytree(report.RESULTS, results)
    path = results / "asr_throughput-cpu.json"
    d = json.loads(path.read_text())
    d["ratio_vs_plain_fused"] += 0.1
    path.write_text(json.dumps(d))
    monkeypatch.setattr(report, "RESULTS", results)
    assert _readme_block() != report.tables()


def test_missing_markers_are_one_clear_error():
    with pytest.raises(SystemExit, match="bench:begin"):
        report.replace_block("no markers here", report.tables())
