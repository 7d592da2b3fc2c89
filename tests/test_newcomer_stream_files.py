"""Issue 41 point 8: `pctr stream` takes only the files ``--files`` names as data (default: the formats'
usual names, compressed too, Criteo's ``day_N``, Spark's ``part-N``) and partitions with a ``_SUCCESS``
marker; a user's README or notes in the folder are left alone. The flag is the stream config's (TOML too)."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = ["day-01.tsv", "frappe.validation.libfm", "clicks.csv", "day_0", "day_1.gz", "part-00000"]
NOT_DATA = ["README.txt", "NOTES.md", "schema.json", "run.sh"]


def test_only_data_files_are_units(tmp_path: Path):
    from mariana.apps.pctr.streams.folder import scan

    for name in DATA + NOT_DATA:
        (tmp_path / name).write_text("1 1:1\n")
    (tmp_path / "p1").mkdir()
    (tmp_path / "p1" / "part-0").write_text("1 1:1\n")
    (tmp_path / "p1" / "_SUCCESS").touch()
    assert sorted(f.name for f in scan(tmp_path)) == sorted([*DATA, "p1/"])


@pytest.mark.parametrize("given", ["flag", "toml"])
def test_the_patterns_are_configurable(tmp_path: Path, given):
    from cliwalk import leaf_parsers
    from mariana.apps.pctr.streams.folder import scan
    from mariana.platform.core.config import resolve_config

    parser = dict(leaf_parsers())[("pctr", "stream")]
    argv = ["--data", str(tmp_path), "--out", str(tmp_path / "run")]
    if given == "flag":
        argv += ["--files", "*.txt, *.log"]
    else:
        (tmp_path / "s.toml").write_text('[input]\nfiles = "*.txt, *.log"\n')
        argv += ["--config", str(tmp_path / "s.toml")]
    args = parser.parse_args(argv)
    cfg = resolve_config(*args._config[:1], args, args._config[1] or {})
    for name in ("a.txt", "b.log", "c.tsv"):
        (tmp_path / name).write_text("1 1:1\n")
    assert sorted(f.name for f in scan(tmp_path, cfg.files)) == ["a.txt", "b.log"]
