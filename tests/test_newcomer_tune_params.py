"""Issue 41 point 5: `tune` records only the parameters a trial ran with (a ``dim`` range under
``model = ["lr"]`` is sampled by Optuna but never given to the trial, so it is not in results.json's row)."""

from __future__ import annotations

from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")


class _Runner:
    """Records the argv of each started trial instead of running it."""

    def __init__(self):
        self.argv: list[list[str]] = []

    def start(self, argv, run_dir, label):
        self.argv.append(argv)
        return {"pid": 0}


def test_a_trial_records_only_the_parameters_that_applied(tmp_path: Path):
    from mariana.platform.jobs.trials import trial_row
    from mariana.platform.tune.apps import app_info
    from mariana.platform.tune.space import load_space
    from mariana.platform.tune.study import TuneOptions, _launch

    space_file = tmp_path / "space.toml"
    space_file.write_text(
        '[params.model]\ntype = "categorical"\nchoices = ["lr"]\n'
        '[params.dim]\ntype = "int"\nlow = 8\nhigh = 16\n'
        '[params.lr]\ntype = "float"\nlow = 1e-3\nhigh = 1e-2\n'
    )
    info = app_info("pctr")
    space = load_space(space_file, info.config_cls())
    opts = TuneOptions("pctr", info, space, 1, 1, tmp_path, "auc", "maximize", 0, "none", 0, [], None)
    study = optuna.create_study(direction="maximize")
    runner = _Runner()
    _launch(study.ask(), opts, runner, tmp_path / "trials")
    assert "--dim" not in runner.argv[0] and "--lr" in runner.argv[0]  # what the trial was given
    (frozen,) = study.get_trials(deepcopy=False)
    assert "dim" in frozen.params  # Optuna sampled it ...
    assert sorted(trial_row(frozen)["params"]) == ["lr", "model"]  # ... but the trial never used it
