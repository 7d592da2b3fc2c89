"""`mariana pctr train --ids dynamic`: the per-field id -> row map (apps/pctr/ids/idmap.py).

More distinct ids than rows -> evictions counted, memory bounded; a never-seen id is served with the OOV
row; export -> `load_predictor` -> a real `mariana serve --pctr` server answer the probabilities of the
offline model; bad flags are refused. (Exact `--resume` with the map: tests/test_pctr_resume.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mariana.apps.pctr.data.encoding import CRITEO_INTS, iter_chunks
from mariana.apps.pctr.ids.idmap import IdMap, key_of
from mariana.apps.pctr.models.predict import load_predictor
from mariana.platform.core.export import load_exported
from test_serving_helpers import pctr_probs, serve
from trained_runs import cli_here, run_ok

R = 32  # rows per field: 31 ids per field, far fewer than the ids of C1/C2 below


def criteo_lines(n: int, seed: int, ads: int = 600, first_ad: int = 0) -> list[str]:
    """Criteo lines whose clicks depend on the ad (C1, ``ads`` distinct ids, power law) and a user (C2)."""
    rng = np.random.default_rng(seed)
    ad = first_ad + np.minimum(rng.zipf(1.3, n), ads) - 1
    user = rng.integers(0, 2000, n)
    effect = np.random.default_rng(7).normal(0, 1.5, first_ad + ads)
    p = 1 / (1 + np.exp(-(effect[ad] - 1.5)))
    y = rng.random(n) < p
    out = []
    for i in range(n):
        ints = [str(rng.integers(0, 50)) if rng.random() > 0.2 else "" for _ in range(CRITEO_INTS)]
        cats = [f"a{ad[i]:07x}", f"u{user[i]:07x}", f"s{rng.integers(0, 5)}"] + [""] * 23
        out.append("\t".join([str(int(y[i])), *ints, *cats]))
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dyn-data")
    (d / "train.tsv").write_text("\n".join(criteo_lines(3000, 0)) + "\n")
    return d


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("dyn-run") / "run"
    run_ok(  # in this process (`trained_runs.run_ok`): the tests read, serve and warm-start from the run
        ["pctr", "train", "--data", data / "train.tsv", "--format", "criteo", "--out", out, "--ids", "dynamic",
         "--rows-per-field", R, "--admit-after", "2", "--evict", "lfu", "--model", "fm", "--dim", "4",
         "--batch-size", "128", "--epochs", "2", "--early-stop", "0", "--no-progress"],
    )  # fmt: skip
    return out


def memory_bytes(m: IdMap) -> int:
    """Bytes held by the map's arrays."""
    return sum(a.nbytes for a in vars(m).values() if isinstance(a, np.ndarray))


@pytest.mark.parametrize("evict, exact", [("lru", True), ("lfu", True), ("lfu", False)])
def test_map_bounds_memory_counts_evictions_and_admits_after_n(evict, exact):
    m = IdMap(2, R, admit_after=2, evict=evict, sketch_width=256)
    if not exact:
        m.exact_limit = 0  # the sampled victims of large tables
    mem = memory_bytes(m)
    rng = np.random.default_rng(0)
    seen_rows = set()
    for _ in range(200):  # 200 x 64 lookups of up to 20000 distinct ids per field
        raw = rng.integers(0, 20000, (64, 2)).astype(np.uint64)
        raw[:, 1] %= 10  # field 1: 10 ids, all fit
        keys = key_of(raw, np.ones_like(raw, bool))
        rows, evicted = m.assign(keys)
        assert ((rows // R) == np.arange(2)).all()  # a field's keys stay in its rows
        seen_rows.update(rows[:, 0].tolist())
        # one key per row within a batch: admitting never evicts a row the same batch uses
        own = rows % R != 0
        pairs = set(zip(rows[own].tolist(), keys[own].tolist()))
        assert len(pairs) == len({r for r, _ in pairs})
        assert (m.lookup(keys) == rows).all()
    c = m.counters()
    assert memory_bytes(m) == mem  # bounded: nothing grows with the number of distinct ids
    assert c["ids_evicted"] > 100 and c["ids_admitted"] - c["ids_evicted"] == c["ids_rows_in_use"]
    assert c["ids_rows_in_use_per_field"] == [R - 1, 10] and c["ids_oov_lookups"] > 0
    assert max(seen_rows) < R and len(seen_rows) == R  # every row of field 0 used, the OOV row included
    if evict != "lru" or not exact:
        return

    # admission after N sightings; an evicted id loses its row; LRU takes the least recently used
    m = IdMap(1, 4, admit_after=2, evict="lru")

    def look(*ids):
        raw = np.array(ids, np.uint64)[:, None]
        return m.assign(key_of(raw, np.ones_like(raw, bool)))[0][:, 0].tolist()

    assert look(5) == [0]  # first sighting: the OOV row
    assert look(5) == [1]  # second: admitted
    look(6), look(7), look(6), look(7)  # rows 2, 3
    assert m.counters()["ids_rows_in_use"] == 3 and m.counters()["ids_evicted"] == 0
    look(8)  # counted, not admitted
    assert look(8) == [1]  # full: evicts 5, the least recently used
    assert m.counters()["ids_evicted"] == 1
    assert m.lookup(key_of(np.array([[5]], np.uint64), np.ones((1, 1), bool))).tolist() == [[0]]


def test_lfu_admits_only_ids_hotter_than_the_victim():
    m = IdMap(1, 3, admit_after=1, evict="lfu")  # 2 rows

    def look(i):
        raw = np.array([[i]], np.uint64)
        return int(m.assign(key_of(raw, np.ones_like(raw, bool)))[0][0, 0])

    assert [look(5), look(5), look(5), look(6), look(6)] == [1, 1, 1, 2, 2]  # counts 3 and 2
    assert [look(7), look(7)] == [0, 0]  # seen 1, then 2 times: not more than the coldest row (2)
    assert look(7) == 2 and m.counters()["ids_evicted"] == 1  # 3 > 2: takes 6's row
    assert m.lookup(key_of(np.array([[6], [5]], np.uint64), np.ones((2, 1), bool)))[:, 0].tolist() == [0, 1]


@pytest.mark.slow
def test_training_counts_evictions_and_exports_the_map(run):
    final = json.loads((run / "metrics.json").read_text())
    ids = final["ids"]
    assert ids["ids_capacity"] == 39 * (R - 1) and ids["ids_rows_in_use"] <= ids["ids_capacity"]
    assert ids["ids_evicted"] > 100 and ids["ids_admitted"] - ids["ids_evicted"] == ids["ids_rows_in_use"]
    assert ids["ids_rows_in_use_per_field"][CRITEO_INTS] == R - 1  # C1: 600 ads in 31 rows
    logged = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    evictions = [r["ids_evicted"] for r in logged if "loss" in r]  # the map's totals in every log record
    assert evictions == sorted(evictions) and evictions[-1] == ids["ids_evicted"]
    state, meta = load_exported(run)
    assert meta["schema"]["ids"] == "dynamic" and state["idmap.row_key"].dtype == torch.int64
    row_key = state["idmap.row_key"].numpy()
    assert row_key.shape == (39 * R,) and (row_key[::R] == -1).all()  # OOV rows hold no id
    assert (row_key >= 0).sum() == ids["ids_rows_in_use"]


def offline_probs(run, lines: list[str]) -> np.ndarray:
    """The exported model scored by hand: keys -> rows through a dict of the exported map, rows never
    trained and ids without a row -> the field's OOV row, then the model's forward."""
    state, meta = load_exported(run)
    pred = load_predictor(run)
    row_of = {int(k): r for r, k in enumerate(state["idmap.row_key"].tolist()) if k >= 0}
    seen = state["seen"].bool()
    batch, errors = pred.parse(lines)
    assert not errors
    keys = batch.ids.numpy()
    rows = np.array([[row_of.get(int(k), f * R) if k >= 0 else f * R for f, k in enumerate(r)] for r in keys])
    rows = torch.from_numpy(rows)
    rows = torch.where(seen[rows], rows, rows - rows % R)
    with torch.no_grad():
        emb = F.embedding(rows, state["table.weight"])
        return torch.sigmoid(pred.model.forward_rows(emb, batch.vals, batch.dense)).numpy()


@pytest.mark.slow
def test_never_seen_id_is_served_with_the_oov_row(run, data):
    pred = load_predictor(run)
    line = next(iter((data / "train.tsv").read_text().splitlines())).split("\t", 1)[1]
    parts = line.split("\t")
    new, empty = list(parts), list(parts)
    new[CRITEO_INTS] = "never-seen-ad-id"
    empty[CRITEO_INTS] = ""  # missing: the OOV row
    probs, errors = pred.predict_lines(["\t".join(new), "\t".join(empty), line])
    assert not errors
    assert probs[0] == pytest.approx(probs[1], abs=1e-7)  # the new id reads the OOV row
    assert probs[2] != pytest.approx(probs[0], abs=1e-4)  # the trained id does not


@pytest.mark.slow
def test_export_load_serve_equal_offline(run, data, tmp_path, tmp_path_factory):
    # a next "day": half the ads are new (never seen in training)
    day2 = criteo_lines(400, 1, ads=600, first_ad=300)
    lines = [ln.split("\t", 1)[1] for ln in day2]
    offline = offline_probs(run, lines)
    pred = load_predictor(run)
    probs, errors = pred.predict_lines(lines)
    assert not errors
    np.testing.assert_allclose(np.array(probs), offline, rtol=0, atol=1e-6)
    # `mariana pctr eval` (the Predictor over a file) equals the training's own last validation
    final = json.loads((run / "metrics.json").read_text())
    p = cli_here(["pctr", "eval", "--model", run, "--data", data / "train.tsv", "--split", "val"], check=True)
    assert f"AUC {final['val_auc']:.4f}" in p.stdout
    srv = serve(["--pctr", run], tmp_path_factory)
    try:
        served = pctr_probs(srv.predict(lines[:200])) + pctr_probs(srv.predict(lines[200:]))
    finally:
        srv.stop()
    np.testing.assert_allclose(np.array(served, dtype=np.float64), offline, rtol=0, atol=1e-6)
    # chunked scoring of a file uses the same map
    path = tmp_path / "day2.tsv"
    path.write_text("\n".join(day2) + "\n")
    chunked = np.concatenate([pred.predict(c) for c in iter_chunks(path, pred.encoder, chunk=128)])
    np.testing.assert_allclose(chunked, offline, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_warm_start_carries_the_map(run, data, tmp_path):
    out = tmp_path / "day2"
    (tmp_path / "d2.tsv").write_text("\n".join(criteo_lines(1000, 3, first_ad=300)) + "\n")
    common = ["--format", "criteo", "--rows-per-field", R, "--model", "fm", "--dim", "4", "--no-progress"]
    p = cli_here(["pctr", "train", "--data", tmp_path / "d2.tsv", "--out", out, "--init-from", run,
                 "--max-steps", "1", *common])  # fmt: skip
    assert p.returncode == 2 and "--ids" in p.stderr  # a hashed run cannot start from a dynamic map
    cli_here(["pctr", "train", "--data", tmp_path / "d2.tsv", "--out", out, "--init-from", run, "--ids",
             "dynamic", "--batch-size", "128", "--max-steps", "3", *common], check=True)  # fmt: skip
    before = load_exported(run)[0]["idmap.row_key"].numpy()
    after = load_exported(out)[0]["idmap.row_key"].numpy()
    kept = (before >= 0) & (after == before)
    assert kept.sum() > 0.5 * (before >= 0).sum()  # most ids keep their rows after 3 steps of a new day


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ids", "bucket"], "--ids"),
        (["--ids", "dynamic", "--admit-after", "0"], "--admit-after must be >= 1"),
        (["--ids", "dynamic", "--evict", "fifo"], "--evict"),
        (["--ids", "dynamic", "--sketch-width", "0"], "--sketch-width must be >= 1"),
        (
            ["--ids", "dynamic", "--servers", "1", "--init-from", "tests"],
            "--init-from with --ids dynamic --servers",
        ),
    ],
)
def test_bad_flags_are_refused(flags, message, data, tmp_path):
    p = cli_here(["pctr", "train", "--data", data / "train.tsv", "--format", "criteo", "--out", tmp_path / "r",
                 *flags])  # fmt: skip
    assert p.returncode == 2 and message in p.stderr, p.stderr
