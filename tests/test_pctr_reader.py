"""pCTR's input as one reader (`mariana.apps.pctr.data.reader.ClickSource`, issue 31): a run resolves, counts
and encodes its ``--data`` once. Observed from outside the reader: the calls of the line counter
(`sources.count_file_lines`) per data file and the lines that go through the encoder."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from helpers import DATA
from mariana.apps.pctr.configs import PctrConfig
from mariana.apps.pctr.data import encoding as data_mod
from mariana.apps.pctr.data import sources as sources_mod
from mariana.apps.pctr.data.encoding import Encoder
from mariana.apps.pctr.train import Setup
from mariana.platform.cli.main import main

DAYS = ("day-01.tsv", "day-02.tsv", "day-03.tsv")
ROWS = 300  # per day: 900 lines, split 0.8,0.2,0 -> train lines 0-719, validation 720-899
TRAIN = [
    "--format", "criteo", "--model", "lr", "--rows-per-field", "64", "--split", "0.8,0.2,0", "--epochs", "2",
    "--batch-size", "64", "--early-stop", "0", "--no-progress", "--seed", "1",
]  # fmt: skip


@pytest.fixture
def days(tmp_path) -> Path:
    """A folder of 3 partitions of real Criteo rows beside a `_SUCCESS` marker (not data)."""
    lines = (DATA / "criteo" / "criteo_sample.tsv").read_text().splitlines(keepends=True)
    d = tmp_path / "days"
    d.mkdir()
    for k, name in enumerate(DAYS):
        (d / name).write_text("".join(lines[k * ROWS : (k + 1) * ROWS]))
    (d / "_SUCCESS").write_text("")
    return d


@pytest.fixture
def watch(monkeypatch) -> tuple[Counter, Counter]:
    """(line counts taken per file name, lines encoded), filled as the code under test reads."""
    counted, encoded = Counter(), Counter()
    count, encode = sources_mod.count_file_lines, Encoder.encode_block

    def counting(path):
        counted[Path(path).name] += 1
        return count(path)

    def encoding(self, block: bytes, has_label: bool = True):
        encoded["lines"] += block.count(b"\n")
        return encode(self, block, has_label)

    monkeypatch.setattr(sources_mod, "count_file_lines", counting)
    monkeypatch.setattr(data_mod, "count_file_lines", counting)  # the single-file path of `count_lines`
    monkeypatch.setattr(Encoder, "encode_block", encoding)
    return counted, encoded


def test_train_and_eval_count_each_file_once_and_encode_each_line_once(days, tmp_path, watch):
    counted, encoded = watch
    run = tmp_path / "run"
    assert main(["pctr", "train", "--data", str(days), "--out", str(run), *TRAIN]) == 0
    assert counted == dict.fromkeys(DAYS, 1)
    # epoch 1 encodes the 720 training lines (epoch 2 reads them encoded), the 180 validation lines
    # are encoded once for both evaluations
    assert encoded["lines"] == 900
    counted.clear()
    encoded.clear()
    assert main(["pctr", "eval", "--model", str(run), "--data", str(days), "--split", "val"]) == 0
    assert counted == dict.fromkeys(DAYS, 1)  # the split is cut once, then read
    assert encoded["lines"] == 180


def test_setup_counts_lines_only_when_a_split_is_needed_and_then_once(days, tmp_path, watch):
    """What a parameter-server server builds (schema, table spec) counts nothing; the workers' shares,
    the batch-size check and the validation set share one count."""
    counted, encoded = watch
    cfg = PctrConfig(
        data=str(days), out=str(tmp_path / "run"), format="criteo", model="lr", rows_per_field=64,
        split="0.8,0.2,0", batch_size=64, servers=1, workers=2,
    )  # fmt: skip
    st = Setup(cfg)
    assert st.spec.num_rows == 39 * 64 and counted == {}
    st.check_batch_size()
    shares = [st.worker_data(w, 2) for w in range(2)]
    assert [(d.lo, d.hi) for d in shares] == [(0, 360), (360, 720)]
    _, labels = st.val_batches("cpu")
    assert len(labels) == 180 and counted == dict.fromkeys(DAYS, 1) and encoded["lines"] == 180
