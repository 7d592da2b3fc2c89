"""pCTR data: streaming Criteo/libFM readers, per-field hashing with a missing/OOV row, log transform,
row-order splits, malformed lines skipped and counted with their line numbers; OOV at prediction time."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from mariana.apps.pctr.data.encoding import (
    Encoder,
    ReadStats,
    Schema,
    count_lines,
    infer_schema,
    iter_batches,
    iter_chunks,
    load_split,
)
from mariana.apps.pctr.models.nets import CTRModel
from mariana.apps.pctr.models.predict import load_predictor
from mariana.platform.core.export import export_model, weights_digest
from mariana.platform.data.splits import split_bounds

R = 1000


@pytest.fixture(scope="module")
def criteo(data_dir):
    return data_dir / "criteo" / "criteo_sample.tsv"


@pytest.fixture(scope="module")
def frappe(data_dir):
    return data_dir / "frappe" / "frappe.validation.libfm"


def test_criteo_sample_parses_with_field_ranges_missing_rows_and_log_counts(criteo):
    schema = infer_schema(criteo, "criteo", R)
    assert (schema.num_fields, schema.num_dense) == (39, 13)
    stats = ReadStats()
    b = load_split(criteo, Encoder(schema), 0, None, stats)
    assert len(b) == count_lines(criteo) == 1000 and stats.skipped == 0
    base = torch.arange(39) * R
    assert torch.all((b.ids >= base) & (b.ids < base + R))  # field f owns rows [f R, (f + 1) R)
    first = criteo.read_text().splitlines()[0].split("\t")
    assert first[12] == "" and b.ids[0, 11] == 11 * R  # empty I12 -> field 11's missing row
    ints = [int(x) if x else 0 for x in first[1:14]]
    torch.testing.assert_close(b.dense[0], torch.log1p(torch.tensor(ints, dtype=torch.float32).clamp(min=0)))
    assert set(b.labels.unique().tolist()) <= {0.0, 1.0}
    again = load_split(criteo, Encoder(schema), 0, None)  # hashing is deterministic
    assert torch.equal(again.ids, b.ids)


def test_malformed_lines_are_skipped_and_counted_with_line_numbers(criteo, tmp_path):
    good = criteo.read_text().splitlines()[:30]
    bad = {
        4: "1\t2\t3",  # too few fields
        9: "x" + good[0][1:],  # bad label
        17: good[1].replace("\t44\t", "\tforty-four\t", 1),  # non-integer count
        25: good[0] + "\textra\tfields",  # too many fields
    }
    lines = list(good)
    for lineno in sorted(bad):
        lines.insert(lineno - 1, bad[lineno])
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join(lines) + "\n")
    stats = ReadStats()
    enc = Encoder(infer_schema(path, "criteo", R))
    chunks = list(iter_chunks(path, enc, chunk=7, stats=stats))  # line numbers survive chunking
    assert sum(len(c) for c in chunks) == stats.rows == 30
    assert stats.skipped == 4 and sorted(stats.errors) == sorted(bad)
    assert "label" in stats.errors[9] and "integer" in stats.errors[17]
    assert "fields" in stats.errors[4] and "fields" in stats.errors[25]


def test_libfm_reader_labels_hashing_and_bad_lines(frappe, tmp_path):
    schema = infer_schema(frappe, "libfm", R)
    assert schema.num_fields == 10 and schema.num_dense == 0 and schema.field_starts[0] == 0
    # the positional reading (ids that do not name their field: the k-th pair is field k)
    schema = dataclasses.replace(schema, field_starts=None, exact_fields=False)
    path = tmp_path / "f.libfm"
    path.write_text(
        "1 5:1 70:1\n"
        "-1 5:1 71:0.5 3:1\n"
        "2 5:1\n"  # bad label (line 3)
        "0 5:1 abc\n"  # not id:value (line 4)
        "\n"  # empty (line 5)
        "1 " + " ".join(f"{i}:1" for i in range(11)) + "\n"  # 11 features > 10 fields (line 6)
        "0 1234:1\n"
    )
    stats = ReadStats()
    b = load_split(path, Encoder(schema), 0, None, stats)
    assert b.labels.tolist() == [1.0, 0.0, 0.0]
    assert stats.skipped == 4 and sorted(stats.errors) == [3, 4, 5, 6]
    assert b.ids[0].tolist()[:3] == [0 * R + 1 + 5, 1 * R + 1 + 70, 2 * R]  # missing field 2 -> row 2R
    assert b.vals[1].tolist()[:4] == [1.0, 0.5, 1.0, 0.0]
    assert b.ids[2, 0] == 1 + 1234 % (R - 1)  # ids beyond the hash space wrap inside the field


def test_streaming_splits_by_row_order_and_rebatching(frappe):
    n = count_lines(frappe)
    bounds = split_bounds(n, (0.8, 0.1, 0.1))
    assert n == 57722 and bounds["train"] == (0, 46178) and bounds["test"] == (51950, n)
    enc = Encoder(infer_schema(frappe, "libfm", R))
    a, b = bounds["val"]
    chunks = iter_chunks(frappe, enc, a, a + 1000, chunk=300)
    sizes = [len(x) for x in iter_batches(chunks, 256)]
    assert sizes == [256, 256, 256, 232]
    first = next(iter_chunks(frappe, enc, a, a + 1, chunk=1))
    line = frappe.read_text().splitlines()[a]
    assert first.labels.item() == (1.0 if line.startswith("1") else 0.0)


def test_unseen_id_at_prediction_maps_to_the_oov_row(tmp_path):
    schema = Schema("libfm", 2, 8, 0)
    torch.manual_seed(0)
    model = CTRModel("fm", schema.num_rows, 2, 0, dim=3)
    seen = torch.zeros(schema.num_rows, dtype=torch.uint8)
    seen[[1 + 4, 8 + 1 + 2]] = 1  # trained rows: field 0 id 4, field 1 id 2
    sd = dict(model.state_dict())
    sd["seen"] = seen
    meta = {"schema": schema.to_dict(), "model": {"kind": "fm", "dim": 3, "hidden": "", "cross_layers": 1}}
    export_model(tmp_path, sd, app="pctr", arch="fm", config={}, extra=meta)
    pred = load_predictor(tmp_path)
    assert (pred.format, pred.version) == ("libfm", weights_digest(sd))
    probs, errors = pred.predict_lines(["4:1 2:1", "6:1 2:1", "0:1", "4:1 bad", "999999:1 2:1"])
    assert list(errors) == [3] and probs[3] is None
    # id 6 and the huge id were never trained: both score exactly like the field's OOV row (row 0)
    with torch.no_grad():
        w = model.table.weight
        oov = model.forward_rows(torch.stack([w[0], w[8 + 3]])[None], torch.ones(1, 2), torch.zeros(1, 0))
        trained = model.forward_rows(torch.stack([w[5], w[11]])[None], torch.ones(1, 2), torch.zeros(1, 0))
    assert probs[1] == pytest.approx(torch.sigmoid(oov).item(), abs=1e-6)
    assert probs[4] == pytest.approx(probs[1], abs=1e-7)
    assert probs[0] == pytest.approx(torch.sigmoid(trained).item(), abs=1e-6)
    batch, errs = pred.parse_json([{"features": [[4, 1], [2, 1]]}, {"features": "x"}])
    assert list(errs) == [1] and np.allclose(pred.predict(batch), [probs[0]], atol=1e-6)


def test_mlp_job_and_pctr_share_one_libfm_parser(tmp_path):
    """`mlp` (platform) and pCTR read libFM through `mariana.platform.data.libfm`: the same rows, ids and
    malformed lines (the mlp job also skips rows without a feature and ignores blank lines)."""
    from mariana.apps.mlp.data import read_libfm

    path = tmp_path / "mixed.libfm"
    path.write_text("1 5:1 70:1\n-1 5:1 71:0.5 3:1\n2 5:1\n0 5:1 abc\n0 7:x\n1\n0 1234:1\n")
    labels, ids, skipped = read_libfm(path)
    schema = Schema("libfm", 3, R, 0)
    stats = ReadStats()
    b = load_split(path, Encoder(schema), 0, None, stats)
    assert sorted(stats.errors) == [3, 4, 5] and skipped == [3, 4, 5, 6]  # line 6: a label, no feature
    assert labels.tolist() == [1.0, 0.0, 0.0] and b.labels.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert ids.tolist() == [[5, 70, -1], [5, 71, 3], [1234, -1, -1]]
    assert b.ids[3, 0] == 1 + 1234 % (R - 1) and b.ids[2].tolist() == [0, R, 2 * R]  # no feature: missing


def _numbered_criteo(path, n: int, bad: tuple[int, ...] = ()) -> None:
    """``n`` Criteo lines whose first count is the line number (so a parsed row names its line);
    the lines in ``bad`` have a non-numeric count and must be skipped."""
    rows = []
    for i in range(n):
        first = "x" if i in bad else str(i)
        rows.append("\t".join([str(i % 2), first, *[""] * 12, *["ab"] * 26]))
    path.write_text("\n".join(rows) + "\n")


def _lines_of(batches) -> list[int]:
    return [round(float(v)) for b in batches for v in torch.expm1(b.dense[:, 0].double())]


@pytest.mark.parametrize("workers,batch,n", [(2, 25, 1000), (3, 16, 960), (3, 16, 1000)])
def test_worker_shares_are_disjoint_and_each_row_trains_once_per_epoch(tmp_path, workers, batch, n):
    from mariana.apps.pctr.data.reader import WorkerData, shard_lines

    path = tmp_path / "numbered.tsv"
    exact = n % workers == 0 and n // workers % batch == 0  # every share is whole batches
    # otherwise a malformed line at a share's edge (the first of worker 1's): skipped, counted once
    bad = () if exact else (n // workers,)
    _numbered_criteo(path, n, bad)
    enc = Encoder(infer_schema(path, "criteo", R))
    shares = [WorkerData(path, enc, 0, n, batch, w, workers, seed=3) for w in range(workers)]
    spans = [shard_lines(0, n, w, workers) for w in range(workers)]
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(spans[w][1] == spans[w + 1][0] for w in range(workers - 1))
    for epoch in (0, 1):
        seen = [_lines_of(d.batches(epoch)) for d in shares]
        steps = shares[0].steps_per_epoch
        assert all(len(s) == steps * batch for s in seen)  # every worker runs the same steps
        for (lo, hi), s in zip(spans, seen, strict=True):
            assert all(lo <= i < hi for i in s)  # only its own share
        every = [i for s in seen for i in s]
        assert len(every) == len(set(every))  # no row twice in an epoch
        assert not set(bad) & set(every)
        if exact:
            assert sorted(every) == list(range(n))  # every row exactly once
    assert sum(d.stats.skipped for d in shares) == len(bad)
    if bad:
        assert list(shares[1].stats.errors) == [bad[0] + 1]  # 1-based line number, in worker 1's count
