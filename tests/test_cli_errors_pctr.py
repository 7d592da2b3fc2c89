"""Bad input to `mariana pctr train|eval`: one line `mariana: error: ...`, exit 2, no traceback, and no
training process started; run through the CLI in this process (`cliwalk.cli`). Each case is (argv after `pctr`, exit code, fragment of stderr); ``{data}``,
``{out}``, ``{toml}`` and ``{run}`` are filled in per test."""

from __future__ import annotations

import dataclasses

import pytest
from cliwalk import cli
from helpers import assert_cli_error
from mariana.apps.pctr.configs import PctrConfig
from mariana.platform.core.config import save_config

TRAIN = ["train", "--data", "{data}", "--out", "{out}", "--preset", "debug", "--no-progress"]
CASES = [
    # (id, argv, TOML text or None, exit, fragment)
    ("hidden-text", [*TRAIN, "--hidden", "abc"], None, 2, "--hidden must be comma-separated"),
    ("hidden-zero", [*TRAIN, "--hidden", "0"], None, 2, "--hidden widths must be >= 1"),
    ("hidden-empty", [*TRAIN, "--hidden", ""], None, 2, "--model deepfm needs at least one"),
    ("dim-negative", [*TRAIN, "--dim", "-3"], None, 2, "--dim must be >= 1, got -3"),
    ("dim-zero", [*TRAIN, "--dim", "0"], None, 2, "--dim must be >= 1, got 0"),
    ("sparse-lr-negative", [*TRAIN, "--sparse-lr", "-1"], None, 2, "--sparse-lr must be a finite number"),
    ("sparse-lr-nan", [*TRAIN, "--sparse-lr", "nan"], None, 2, "--sparse-lr must be a finite number"),
    ("lr-nan", [*TRAIN, "--lr", "nan"], None, 2, "--lr must be a finite number"),
    ("dropout", [*TRAIN, "--dropout", "1.5"], None, 2, "--dropout must be in [0, 1)"),
    ("val-rows", [*TRAIN, "--val-rows", "-1"], None, 2, "--val-rows must be >= 0, got -1"),
    ("prefetch", [*TRAIN, "--prefetch", "-1"], None, 2, "--prefetch must be >= 0, got -1"),
    ("ckpt-every", [*TRAIN, "--ckpt-every", "-1"], None, 2, "--ckpt-every must be >= 0"),
    ("split-sum", [*TRAIN, "--split", "0.5,0.6,0.1"], None, 2, "--split must be three fractions"),
    ("batch-too-big", [*TRAIN, "--batch-size", "1000"], None, 2, "--batch-size 1000 is larger than the training split"),
    ("batch-too-big-ps", [*TRAIN, "--batch-size", "250", "--servers", "1", "--workers", "2"], None, 2,
     "--batch-size 250 x 2 workers is larger than the training split"),
    ("workers-without-servers", [*TRAIN, "--workers", "2"], None, 2, "--workers applies to --servers >= 1 only (this run: --servers 0)"),
    ("schedule-on-servers", [*TRAIN, "--servers", "1", "--schedule", "cosine"], None, 2,
     "--schedule applies to --servers 0 only (this run: --servers 1)"),
    ("toml-model", [*TRAIN, "--config", "{toml}"], 'model = "xgboost"\n', 2, "field 'model'"),
    ("toml-sparse-optimizer", [*TRAIN, "--config", "{toml}"], 'sparse_optimizer = "foo"\n', 2,
     "field 'sparse_optimizer'"),
    ("toml-unused-field", [*TRAIN, "--config", "{toml}"], 'grad_comm = "bf16"\n', 2,
     "unknown field 'grad_comm'"),
    ("toml-unused-momentum", [*TRAIN, "--config", "{toml}"], "momentum = 0.5\n", 2,
     "unknown field 'momentum'"),
    ("unused-flag-hidden", [*TRAIN, "--grad-comm", "bf16"], None, 2, "unrecognized arguments: --grad-comm"),
    ("resume-empty", ["train", "--data", "{data}", "--out", "{out}", "--no-progress", "--resume"], None, 2,
     "--resume: no checkpoint in"),
    ("out-is-a-file", ["train", "--data", "{data}", "--out", "{data}", "--preset", "debug"], None, 2,
     "is an existing file"),
    ("over-trained-run", ["train", "--data", "{data}", "--out", "{run}", "--preset", "debug"], None, 2,
     "already holds a trained run; pass --resume"),
    ("resume-other-model", ["train", "--data", "{data}", "--out", "{run}", "--resume",
                            "--model", "fm", "--dim", "8"], None, 2, "model: 'deepfm' -> 'fm'"),
    ("eval-missing-model", ["eval", "--model", "{out}/nothing", "--data", "{data}"], None, 2,
     "--model"),
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(data_dir, tmp_path_factory):
    """500 Frappe lines (400 training rows at the default split)."""
    lines = (data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines(keepends=True)
    path = tmp_path_factory.mktemp("pctr-errors") / "tiny.libfm"
    path.write_text("".join(lines[:500]))
    return path


def fake_run(folder, data) -> None:
    """A run directory with a checkpoint and the config.toml of a deepfm run (no training needed to test
    the refusals, which happen before anything is loaded)."""
    (folder / "checkpoints" / "step_00000020").mkdir(parents=True)
    (folder / "checkpoints" / "latest").write_text("step_00000020\n")
    (folder / "model.safetensors").write_bytes(b"")
    cfg = dataclasses.replace(
        PctrConfig(), data=str(data), out=str(folder), batch_size=256, max_steps=20, dim=4, hidden="16",
        rows_per_field=1024, log_every=5, preset="debug", progress=False,
    )  # fmt: skip
    save_config(cfg, folder / "config.toml")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(case, tiny, tmp_path, capfd):
    _, argv, toml, code, fragment = case
    run = tmp_path / "run"
    fake_run(run, tiny)
    (tmp_path / "job.toml").write_text(toml or "")
    subst = {
        "data": str(tiny),
        "out": str(tmp_path / "out"),
        "toml": str(tmp_path / "job.toml"),
        "run": str(run),
    }
    p = cli(["pctr", *(a.format(**subst) for a in argv)], capfd)
    assert_cli_error(p, fragment, code=code)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # nothing was trained


def test_legacy_run_without_checkpoint_is_not_trained_over(tiny, tmp_path, capfd):
    """A finished run from before the marker, proven by its own files (issue 41 point 1: config.toml of
    pctr's sections plus metrics.jsonl; a metrics.json alone is a user's file, tests/test_newcomer_run_folders.py)."""
    from mariana.apps.pctr.configs import PctrConfig
    from mariana.platform.core.config import save_config

    run = tmp_path / "old"
    run.mkdir()
    save_config(PctrConfig(out=str(run)), run / "config.toml")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "metrics.json").write_text("{}\n")
    p = cli(["pctr", "train", "--data", tiny, "--out", run, "--preset", "debug"], capfd)
    assert_cli_error(p, "already holds a trained run; pass --resume")
