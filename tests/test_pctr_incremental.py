"""Incremental training (`--init-from RUN --init-train-state`) and multi-file ``--data`` (apps/pctr/data/sources.py).

Training days 1..3 in one run equals training day 1, then day 2 from it, then day 3 from that: one pass
each, no shuffling (one epoch is read in order), no validation (``--split 1,0,0``), same seed. Every day
has a whole number of batches (1024 rows, batch 256) so both see the same batches: a batch of the one run
never spans two days (the reader concatenates the files; it does not cut batches at file ends)."""

from __future__ import annotations

import shutil

import pytest
import torch
from mariana.apps.pctr.configs import PctrConfig
from mariana.apps.pctr.data.drift import DriftSettings, generate
from mariana.apps.pctr.data.encoding import Encoder, ReadStats, count_lines, infer_schema, iter_chunks
from mariana.apps.pctr.data.sources import resolve_sources
from mariana.apps.pctr.train import train_local
from mariana.platform.cli.main import check_command
from mariana.platform.core.errors import DataError, MarianaError
from safetensors.torch import load_file
from trained_runs import cli_here, run_ok

pytestmark = pytest.mark.slow
ROWS = 1024
COMMON = [
    "--format", "criteo", "--model", "deepfm", "--dim", "4", "--hidden", "8", "--rows-per-field", "256",
    "--split", "1,0,0", "--epochs", "1", "--batch-size", "256", "--no-progress", "--seed", "5",
    "--schedule", "constant", "--dropout", "0",  # one run equals three runs: a constant rate, no dropout draws
]  # fmt: skip


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """3 generated days of 1024 rows, with a `_SUCCESS` marker and a half-written temporary file beside."""
    d = tmp_path_factory.mktemp("days")
    generate(d, DriftSettings(days=3, rows_per_day=ROWS, ads=300, users=2000, seed=11), lambda s: None)
    (d / "_SUCCESS").write_text("")
    (d / ".day-04.tsv.x1y2.tmp").write_text("1\tnot a whole line")
    (d / "day-04.tsv.part").write_text("garbage\n")
    return d


def _train(data, out, *extra):
    return cli_here(["pctr", "train", "--data", data, "--out", out, *COMMON, *extra], check=True)


def _train_here(data, out, **kw):
    """`_train` in this process, through the function the CLI calls (no interpreter start-up)."""
    cfg = PctrConfig(
        data=str(data), out=str(out), format="criteo", model="deepfm", dim=4, hidden="8", rows_per_field=256,
        split="1,0,0", epochs=1, batch_size=256, progress=False, seed=5, schedule="constant", dropout=0.0, **kw,
    )  # fmt: skip
    return train_local(cfg)


def test_three_days_in_one_run_equal_three_incremental_runs(days, tmp_path):
    # the one run and day 1 through the CLI in this process (`trained_runs.run_ok`: no interpreter
    # start-up); the incremental days 2 and 3 as real subprocesses. The folder: day-01..03 in name order,
    # markers left out.
    run_ok(["pctr", "train", "--data", days, "--out", tmp_path / "all", *COMMON])
    run_ok(["pctr", "train", "--data", days / "day-01.tsv", "--out", tmp_path / "d1", *COMMON])
    for d in (2, 3):
        prev = tmp_path / f"d{d - 1}"
        out = _train(days / f"day-0{d}.tsv", tmp_path / f"d{d}", "--init-from", prev, "--init-train-state")
        assert "no validation rows" in out.stdout
    one, chained = (
        load_file(tmp_path / "all" / "model.safetensors"),
        load_file(tmp_path / "d3" / "model.safetensors"),
    )
    assert sorted(one) == sorted(chained) and "table.weight" in one and "head.weight" in one
    for k in one:
        torch.testing.assert_close(chained[k].float(), one[k].float(), rtol=0, atol=1e-6, msg=k)
    # the row-optimiser state (Adagrad accumulators) and Adam's moments went on too
    ck_one = torch.load(
        next((tmp_path / "all" / "checkpoints").glob("step_*")) / "state.pt", weights_only=True
    )
    ck_3 = torch.load(next((tmp_path / "d3" / "checkpoints").glob("step_*")) / "state.pt", weights_only=True)
    for k, v in ck_one["rows"]["state"].items():
        torch.testing.assert_close(ck_3["rows"]["state"][k], v, rtol=0, atol=1e-6)
    adam_one, adam_3 = ck_one["dense_opt"]["state"], ck_3["dense_opt"]["state"]
    assert adam_3[0]["step"] == adam_one[0]["step"] == 12  # 3 days x 4 batches
    torch.testing.assert_close(adam_3[0]["exp_avg_sq"], adam_one[0]["exp_avg_sq"], rtol=0, atol=1e-6)
    # the same list of files as one run; a warm start from the weights alone (fresh optimisers) differs
    _train_here(",".join(str(days / f"day-0{d}.tsv") for d in (1, 2)), tmp_path / "list12")
    _train_here(days / "day-02.tsv", tmp_path / "w2", init_from=str(tmp_path / "d1"))
    listed, d2, w2 = (load_file(tmp_path / r / "model.safetensors") for r in ("list12", "d2", "w2"))
    torch.testing.assert_close(d2["table.weight"], listed["table.weight"], rtol=0, atol=1e-6)
    assert (w2["table.weight"] - listed["table.weight"]).abs().max() > 1e-4


def test_folder_and_list_sources(days, tmp_path):
    src = resolve_sources(str(days))
    assert [p.name for p in src.paths] == ["day-01.tsv", "day-02.tsv", "day-03.tsv"]
    assert count_lines(str(days)) == 3 * ROWS and src.offsets() == [0, ROWS, 2 * ROWS]
    # a malformed line is skipped and reported with its file and its line in that file
    bad = tmp_path / "bad"
    bad.mkdir()
    for d in (1, 2):
        lines = (days / f"day-0{d}.tsv").read_text().splitlines(keepends=True)
        if d == 2:
            lines[6] = "maybe\t1\t2\n"
        (bad / f"day-0{d}.tsv").write_text("".join(lines))
    enc = Encoder(infer_schema(bad, "criteo", 256))
    stats = ReadStats()
    rows = sum(len(b) for b in iter_chunks(str(bad), enc, ROWS - 10, ROWS + 20, stats=stats))
    assert rows == 29 and stats.skipped == 1
    assert stats.errors == {ROWS + 7: f"{bad / 'day-02.tsv'} line 7: expected 40 tab-separated fields, got 3"}
    out = cli_here(["pctr", "eval", "--model", tmp_path / "none", "--data", bad])
    assert out.returncode == 2
    run = tmp_path / "r"
    assert _train_here(bad, run)["skipped_lines"] == 1
    ev = cli_here(
        ["pctr", "eval", "--model", run, "--data", f"{bad / 'day-01.tsv'},{bad / 'day-02.tsv'}"], check=True
    )
    assert f"{bad / 'day-02.tsv'} line 7: expected 40" in ev.stderr and f"{2 * ROWS - 1} rows" in ev.stdout
    assert (run / "eval" / "day-01_to_day-02.json").is_file()
    # clear errors: an empty folder, a missing file in a list
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_SUCCESS").write_text("")
    with pytest.raises(DataError, match="no data files"):
        resolve_sources(str(tmp_path / "empty"))
    miss = cli_here(
        [
            "pctr",
            "train",
            "--data",
            f"{days / 'day-01.tsv'},{tmp_path / 'nope.tsv'}",
            "--out",
            tmp_path / "m",
            *COMMON,
        ]
    )
    assert (
        miss.returncode == 2
        and "nope.tsv: no such data file" in miss.stderr
        and "Traceback" not in miss.stderr
    )


def test_init_train_state_needs_a_one_process_checkpoint(days, tmp_path):
    with pytest.raises(MarianaError, match="--init-train-state needs --init-from"):
        PctrConfig(init_train_state=True).validate()
    src = tmp_path / "src"
    _train_here(days / "day-01.tsv", src)
    with pytest.raises(MarianaError, match="--init-train-state applies to --servers 0 only"):
        check_command(
            ["pctr", "train", "--data", "x", "--init-from", str(src), "--init-train-state", "--servers", "1"]
        )
    export_only = tmp_path / "export-only"  # a model folder without the run's checkpoints
    export_only.mkdir()
    for name in ("model.safetensors", "model.json"):
        shutil.copy(src / name, export_only / name)
    with pytest.raises(MarianaError, match="has no one-process checkpoint"):
        _train_here(days / "day-02.tsv", tmp_path / "w", init_from=str(export_only), init_train_state=True)
    with pytest.raises(MarianaError, match="checkpoint does not fit this model"):
        _train_here(
            days / "day-02.tsv", tmp_path / "o", init_from=str(src), init_train_state=True, optimizer="sgd"
        )
