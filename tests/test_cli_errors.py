"""Bad input gets one clear message and exit code 2, never a traceback."""

import pytest
from helpers import run_cli


def assert_clean_error(p, *needles):
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    for n in needles:
        assert n in p.stderr, p.stderr


def test_unknown_flag(tmp_path):
    p = run_cli(["mlp", "train", "--data", "x", "--out", tmp_path / "r", "--no-such-flag", "1"])
    assert_clean_error(p, "unrecognized arguments: --no-such-flag")


def test_wrong_type_flag(tmp_path):
    p = run_cli(["mlp", "train", "--data", "x", "--out", tmp_path / "r", "--lr", "fast"])
    assert_clean_error(p, "--lr", "expected float")


def test_wrong_type_in_toml(tmp_path, data_dir):
    cfg = tmp_path / "job.toml"
    cfg.write_text('batch_size = 32\nepochs = "two"\n')
    p = run_cli(
        [
            "mlp",
            "train",
            "--data",
            data_dir / "frappe" / "frappe.validation.libfm",
            "--out",
            tmp_path / "r",
            "--config",
            cfg,
        ]
    )
    assert_clean_error(p, "job.toml: field 'epochs': expected int, got str 'two'")


def test_missing_data_path(tmp_path):
    p = run_cli(
        ["mlp", "train", "--data", tmp_path / "nowhere.libfm", "--out", tmp_path / "r", "--workers", "2"]
    )
    assert_clean_error(p, "nowhere.libfm: no such file or directory")
    assert "launching" not in p.stderr  # caught before any worker starts


@pytest.mark.parametrize("args", [["--help"], ["mlp", "train", "--help"]])
def test_help(args):
    p = run_cli(args)
    assert p.returncode == 0 and "usage: mariana" in p.stdout
