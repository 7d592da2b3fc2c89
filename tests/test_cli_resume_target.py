"""Issue 30.5: ``--resume`` with a target the run has already reached (a lower --max-steps, fewer
--epochs) trains nothing, so it is refused in one line (exit 2) and the run's metrics.json is left as it
was (it used to be rewritten with train_loss NaN, samples_per_s 0). Generated over every command with
--resume and --max-steps, plus one real run for the epochs case (found after the checkpoint is loaded)."""

import pytest
from cliwalk import leaf_parsers, option, run_main
from mariana.platform.cli.outputs import mark

RESUMABLE = [
    p for p, parser in leaf_parsers() if option(parser, "--resume") and option(parser, "--max-steps")
]


def test_the_walk_finds_every_train_command():
    assert {("mlp", "train"), ("asr", "train"), ("vision", "train"), ("pctr", "train")} <= set(RESUMABLE)


@pytest.mark.parametrize("cmd", RESUMABLE, ids=" ".join)
def test_resume_below_the_done_steps_is_refused(cmd, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000004\n")
    mark(run, " ".join(cmd))  # the command's own run (an unmarked checkpoint alone proves none: issue 41.1)
    data = tmp_path / "data.txt"
    data.write_text("1 0:1\n")
    rc, out, err = run_main([*cmd, "--data", data, "--out", run, "--resume", "--max-steps", "2"], capsys)
    assert rc == 2 and "already done 4 steps" in err and len(err.strip().splitlines()) == 1, err


def test_resume_with_fewer_epochs_than_done_is_refused(tmp_path, data_dir, capsys):
    data = tmp_path / "f.libfm"
    lines = (data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines()[:400]
    data.write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    argv = ["mlp", "train", "--data", data, "--out", run, "--preset", "debug", "--batch-size", "128"]
    rc, out, err = run_main([*argv, "--max-steps", "5", "--no-progress"], capsys)
    assert rc == 0, err
    before = (run / "metrics.json").read_text()
    rc, out, err = run_main([*argv, "--max-steps", "0", "--epochs", "1", "--resume", "--no-progress"], capsys)
    assert rc == 2 and "already done 5 steps" in err, err
    assert (run / "metrics.json").read_text() == before
