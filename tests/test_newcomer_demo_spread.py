"""Issue 41 point 13: the demo's figures move between runs, so the README quotes their spread over 3 seeds
from a bench result file (`bench/demo_spread.py` -> bench/results/demo_spread-cpu.json), not one run's
number as the result. Checked: the file records the machine, versions, date, commit
and 3 seeds per part; the README's spread table is the file's; the bench's commands use scripts/demo.sh's
settings (so its spread is the demo's)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "demo_spread-cpu.json"
sys.path.insert(0, str(ROOT / "bench"))


def test_the_result_file_records_the_machine_and_three_seeds_per_part():
    d = json.loads(RESULT.read_text())
    assert {"date", "commit", "torch", "python", "cpu_count", "host"} <= set(d["machine"])
    assert d["results"] and "demo_spread.py" in d["command"]
    for r in d["results"]:
        assert len(r["seeds"]) == 3 == len(r["values"]), r
        assert r["min"] == min(r["values"]) and r["max"] == max(r["values"]), r


def test_the_readme_quotes_the_files_spread():
    from demo_spread import readme_rows

    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- demo-spread:begin -->\n", 1)[1].split("<!-- demo-spread:end -->", 1)[0]
    assert block.strip().splitlines() == readme_rows(RESULT)


def test_the_bench_runs_the_demos_settings():
    """Each bench command's ``--flag value`` pairs (but --seed, --force and run paths) are in demo.sh."""
    from demo_spread import PARTS

    demo = " ".join((ROOT / "scripts" / "demo.sh").read_text().replace("\\\n", " ").split())
    for name, (_, _, commands) in PARTS.items():
        for cmd in commands:
            words = [w for w in cmd if "{run}" not in w and "shared/data" not in w]
            assert " ".join(words[:2]) in demo, (name, words[:2])
            for i, w in enumerate(words):
                value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else ""
                if (
                    w.startswith("--")
                    and w not in ("--seed", "--force", "--out", "--model", "--data")
                    and value
                ):
                    assert f"{w} {shlex.quote(value)}" in demo, (name, w, value)
