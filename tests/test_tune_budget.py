"""Issue 30.6: continuing a study (the same tune --out) with other flags for its trials (another
--max-steps, other data) is refused in one line instead of ranking, e.g., 5-step and 40-step trials in
one table."""

import pytest
from cliwalk import run_main
from helpers import run_cli

pytest.importorskip("optuna")

SPACE = """
[params.lr]
type = "float"
low = 1e-3
high = 1e-2

[fixed]
early_stop = 0
"""


def test_continuing_a_study_with_another_budget_is_refused(tmp_path, data_dir, capsys):
    data = tmp_path / "f.libfm"
    data.write_text(
        "\n".join((data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines()[:300])
    )
    space = tmp_path / "space.toml"
    space.write_text(SPACE)
    out = tmp_path / "tune"
    base = ["tune", "pctr", "--space", space, "--trials", "1", "--out", out, "--local", "--pruner", "none"]
    train = ["--preset", "debug", "--batch-size", "32", "--data", data, "--max-steps", "2"]
    first = run_cli([*base, *train])  # a tuner that runs trials: a fork of the zygote (test_tune.py says why)
    assert first.returncode == 0, first.stderr
    rc, stdout, err = run_main([*base, *train[:-1], "40"], capsys)  # --max-steps 40
    assert rc == 2 and "its trials ran with" in err and "--max-steps 40" in err, err
    space.write_text(SPACE.replace("early_stop = 0", "early_stop = 3"))  # a fixed value changed
    rc, stdout, err = run_main([*base, *train], capsys)
    assert rc == 2 and "--early-stop 3" in err, err
    space.write_text(SPACE)
    again = run_cli([*base, *train, "--trials", "2"])  # the same flags: continued
    assert again.returncode == 0, again.stderr
