"""The drifting click-log generator (`mariana pctr drift-logs`, apps/pctr/data/drift.py): deterministic from
its seed, the days, rows and Criteo columns asked for, read by the pCTR reader without a skipped line, and
the drift it promises (new ad ids every day, a frozen world with --drift 0 --new-ads 0). The command runs in
this process (`trained_runs.cli_here`): the files, output and exit code of a subprocess, without one."""

from __future__ import annotations

import json

import numpy as np
from mariana.apps.pctr.data.drift import DriftSettings, DriftWorld, generate, hex8
from mariana.apps.pctr.data.encoding import Encoder, ReadStats, infer_schema, load_split
from trained_runs import cli_here


def _files(folder):
    return sorted(p.name for p in folder.iterdir())


def test_cli_writes_days_deterministically(tmp_path):
    cmd = ["pctr", "drift-logs", "--days", "3", "--rows-per-day", "2000", "--ads", "500"]
    a = cli_here([*cmd, "--out", tmp_path / "a", "--seed", "7"], check=True)
    cli_here([*cmd, "--out", tmp_path / "b", "--seed", "7"], check=True)
    cli_here([*cmd, "--out", tmp_path / "c", "--seed", "8"], check=True)
    assert _files(tmp_path / "a") == [
        ".mariana-output",
        "_generator.json",
        "day-01.tsv",
        "day-02.tsv",
        "day-03.tsv",
    ]
    assert a.stderr.count("rows, CTR") == 3  # one progress line per day
    for day in ("day-01.tsv", "day-02.tsv", "day-03.tsv"):
        assert (tmp_path / "a" / day).read_bytes() == (tmp_path / "b" / day).read_bytes()
        assert (tmp_path / "a" / day).read_bytes() != (tmp_path / "c" / day).read_bytes()
    schema = infer_schema(tmp_path / "a" / "day-02.tsv", "criteo", 1024)
    enc = Encoder(schema)
    for day in ("day-01.tsv", "day-03.tsv"):
        path = tmp_path / "a" / day
        lines = path.read_text().splitlines()
        assert len(lines) == 2000
        assert {len(line.split("\t")) for line in lines} == {1 + 13 + 26}
        assert {line[0] for line in lines} == {"0", "1"}
        stats = ReadStats()
        batch = load_split(path, enc, 0, None, stats=stats)
        assert stats.skipped == 0 and len(batch) == 2000
        assert 0.03 < float(batch.labels.mean()) < 0.4
    meta = json.loads((tmp_path / "a" / "_generator.json").read_text())
    assert meta["settings"]["seed"] == 7 and [d["day"] for d in meta["days"]] == [1, 2, 3]
    bad = cli_here([*cmd, "--out", tmp_path / "d", "--new-ads", "1.5"])
    assert bad.returncode == 2 and "--new-ads" in bad.stderr and "Traceback" not in bad.stderr


def test_ads_are_born_and_retired_and_drift_zero_freezes_them(tmp_path):
    facts = generate(
        tmp_path / "w", DriftSettings(days=3, rows_per_day=5000, ads=1000, seed=1), lambda s: None
    )
    ads = [
        {line.split("\t")[14] for line in (tmp_path / "w" / f"day-0{d}.tsv").read_text().splitlines()}
        for d in (1, 2, 3)
    ]
    new_share = len(ads[2] - ads[0] - ads[1]) / len(ads[2])
    assert 0.1 < new_share < 0.5  # a quarter of the alive ads are born each day (by default)
    assert all(0.15 < f["new_ad_traffic"] < 0.35 for f in facts[1:])
    assert all(0.25 < f["new_user_traffic"] < 0.35 for f in facts)
    assert all(0.6 < f["oracle_auc"] < 0.95 for f in facts)  # the clicks follow a learnable signal
    frozen = DriftWorld(DriftSettings(rows_per_day=100, ads=100, seed=1, drift=0.0, new_ads=0.0))
    affin, ad_eff = frozen.affin.copy(), frozen.ad_eff.copy()
    frozen.day(), frozen.day()
    assert np.array_equal(frozen.affin, affin) and np.array_equal(frozen.ad_eff, ad_eff)
    moving = DriftWorld(DriftSettings(rows_per_day=100, ads=100, seed=1))
    before = moving.affin.copy()
    moving.day(), moving.day()
    assert not np.allclose(moving.affin, before)
    ids = np.arange(1000)
    assert len(set(hex8(ids, 1).tolist())) == 1000 and hex8(ids, 1)[0] != hex8(ids, 2)[0]


def test_force_rerun_replaces_the_days_it_owns_and_nothing_else(tmp_path):
    """`drift-logs --force` over its own earlier output with fewer days: the older days past the new
    count and unfinished temporary files are gone, `_generator.json` describes exactly the files left,
    and a file the user put there stays."""
    out = tmp_path / "days"
    cmd = ["pctr", "drift-logs", "--rows-per-day", "300", "--ads", "50", "--out", out]
    cli_here([*cmd, "--days", "3", "--seed", "1"], check=True)
    (out / "notes.txt").write_text("mine")
    (out / ".day-04.tsv.abc123.tmp").write_text("half a day from a killed run")
    refused = cli_here([*cmd, "--days", "2", "--seed", "2"])
    assert refused.returncode == 2 and "--force" in refused.stderr
    assert "day-03.tsv" in _files(out)  # the refusal changed nothing
    cli_here([*cmd, "--days", "2", "--seed", "2", "--force"], check=True)
    assert _files(out) == [".mariana-output", "_generator.json", "day-01.tsv", "day-02.tsv", "notes.txt"]
    meta = json.loads((out / "_generator.json").read_text())
    assert meta["settings"]["seed"] == 2 and [d["day"] for d in meta["days"]] == [1, 2]
    cli_here([*cmd, "--days", "2", "--seed", "2", "--out", tmp_path / "fresh"], check=True)
    for day in ("day-01.tsv", "day-02.tsv"):  # the same bytes as a run into an empty folder
        assert (out / day).read_bytes() == (tmp_path / "fresh" / day).read_bytes()
    assert (out / "notes.txt").read_text() == "mine"
