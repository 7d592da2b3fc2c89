"""Issue 30.12 (--resume): a resumed run takes its settings from RUN/config.toml, so `--out RUN --resume`
(plus what may change, e.g. a larger --max-steps) is enough; the preset and every original flag no
longer need retyping. Generated over every command with --resume and --max-steps: a run whose saved
config says max_steps 7 and whose checkpoint is at step 9 is refused for exactly that, with no other
flag typed (the old code read the defaults: no --data, max_steps 0)."""

import pytest
from cliwalk import leaf_parsers, option, run_main
from mariana.platform.core.config import save_config

RESUMABLE = [
    (p, parser)
    for p, parser in leaf_parsers()
    if option(parser, "--resume") and option(parser, "--max-steps")
]


@pytest.mark.parametrize("path,parser", RESUMABLE, ids=[" ".join(p) for p, _ in RESUMABLE])
def test_resume_reads_the_runs_config(path, parser, tmp_path, capsys):
    cls = parser.get_default("_config")[0]
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000009\n")
    data = tmp_path / "data.txt"
    data.write_text("1 0:1\n")
    save_config(cls(data=str(data), out=str(run), max_steps=7), run / "config.toml")
    rc, out, err = run_main([*path, "--out", run, "--resume"], capsys)
    assert rc == 2 and "already done 9 steps and --max-steps is 7" in err, err


def test_resume_with_only_out_and_a_new_length(tmp_path, data_dir, capsys):
    data = tmp_path / "f.libfm"
    data.write_text(
        "\n".join((data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines()[:300])
    )
    run = tmp_path / "run"
    argv = ["pctr", "train", "--data", data, "--out", run, "--preset", "debug", "--batch-size", "32"]
    rc, out, err = run_main([*argv, "--dim", "8", "--max-steps", "2", "--no-progress"], capsys)
    assert rc == 0, err
    rc, out, err = run_main(["pctr", "train", "--out", run, "--resume", "--max-steps", "4"], capsys)
    assert rc == 0, err
    steps = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"step": 4' in line]
    assert steps, "the resumed run did not reach step 4"
