"""Parameter-server shards: row placement, exactly-once pushes, row optimisers, and a real RPC job
(2 servers + 1 worker under torchrun over loopback) checking where pulled/pushed rows land."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import ROOT, run_torchrun
from mariana.platform.ps.server import ParamServer
from mariana.platform.ps.shard import EmbeddingShard, TableSpec, init_rows, local_rows, split_by_shard
from mariana.platform.sparse.rules import RowOptConfig, apply_rows, coalesce, init_state


def test_rows_are_placed_round_robin_and_init_does_not_depend_on_sharding():
    spec = TableSpec("t", 11, 4, init_std=1.0)
    full = init_rows(spec, seed=5)
    assert torch.all(full[:, 0] == 0)  # linear weights start at zero, as in plain LR
    for S in (1, 2, 3):
        parts = [init_rows(spec, 5, s, S) for s in range(S)]
        assert [p.shape[0] for p in parts] == [local_rows(11, s, S) for s in range(S)]
        for s in range(S):
            assert torch.equal(parts[s], full[s::S])
    rows = torch.tensor([10, 0, 3, 7, 4])
    split = split_by_shard(rows, 3)
    for s, (pos, loc) in enumerate(split):
        assert torch.equal(rows[pos] % 3, torch.full_like(pos, s))
        assert torch.equal(loc, rows[pos] // 3)
    assert sorted(torch.cat([p for p, _ in split]).tolist()) == list(range(5))


def test_push_updates_exactly_the_pushed_rows_once():
    spec = TableSpec("t", 8, 2, init_std=1.0)
    shard = EmbeddingShard([spec], 0, 1, RowOptConfig(rule="sgd", lr=0.1), seed=1)
    w0 = shard.weight["t"].clone()
    rows, g = torch.tensor([1, 5]), torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert shard.push("t", rows, g, worker=0, step=0)
    assert not shard.push("t", rows, g, worker=0, step=0)  # a replayed step changes nothing
    assert shard.push("t", rows, g, worker=1, step=0)  # another worker's step 0 is new
    changed = (shard.weight["t"] != w0).any(1).nonzero().flatten().tolist()
    assert changed == [1, 5]
    torch.testing.assert_close(shard.weight["t"][rows], w0[rows] - 0.2 * g)
    assert shard.seen["t"].nonzero().flatten().tolist() == [1, 5]
    assert shard.worker_step(0) == 0 and shard.worker_step(2) == -1
    sd = shard.state_dict()
    other = EmbeddingShard([spec], 0, 1, RowOptConfig(rule="sgd", lr=0.1), seed=9)
    other.load_state_dict(sd)
    assert torch.equal(other.weight["t"], shard.weight["t"]) and other.worker_step(1) == 0


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "ftrl"])
def test_row_rules_touch_only_given_rows_and_match_dense_math(rule):
    torch.manual_seed(0)
    cfg = RowOptConfig(rule=rule, lr=0.1, ftrl_l1=0.05 if rule == "ftrl" else 0.0)
    w = torch.randn(6, 3)
    st = init_state(rule, w, cfg)
    w0 = w.clone()
    rows, g = coalesce(torch.tensor([4, 1, 4]), torch.ones(3, 3))  # row 4 twice: summed
    assert rows.tolist() == [1, 4] and g[1].tolist() == [2.0, 2.0, 2.0]
    apply_rows(w, st, rows, g, cfg)
    untouched = [0, 2, 3, 5]
    assert torch.equal(w[untouched], w0[untouched])
    if rule == "sgd":
        torch.testing.assert_close(w[rows], w0[rows] - 0.1 * g)
    elif rule == "adagrad":  # first step: g / sqrt(g^2) = sign(g)
        torch.testing.assert_close(w[rows], w0[rows] - 0.1 * torch.ones_like(g), atol=1e-6, rtol=0)
    else:  # FTRL from zero state: z = g - sigma*w; weights solve the proximal step (l1 may zero them)
        n = g * g
        z = g - (n.sqrt() / 0.1) * w0[rows]
        ref = torch.where(z.abs() <= 0.05, 0.0, -(z - z.sign() * 0.05) / ((1.0 + n.sqrt()) / 0.1))
        torch.testing.assert_close(w[rows], ref)


@pytest.mark.slow
def test_rpc_pull_push_across_two_servers(tmp_path):
    """Real processes: rows requested by a worker come back from the right server in the right order;
    a push changes exactly the pushed rows on the servers that own them, and a replay is ignored."""
    run_torchrun(ROOT / "tests" / "ps_pushpull_job.py", 3, tmp_path)
    r = torch.load(tmp_path / "result.pt", weights_only=True)
    spec = TableSpec("t", 10, 3, init_std=1.0)
    full = init_rows(spec, seed=3)
    torch.testing.assert_close(r["before"], full, rtol=0, atol=0)
    expect = full.clone()
    expect[[7, 1, 4]] -= 0.5  # sgd lr 0.5, gradient of ones, applied once
    torch.testing.assert_close(r["after_perm"], expect[r["perm"]], rtol=0, atol=0)
    for s in range(2):  # server s holds global rows s, s+2, ... (local row r // 2)
        weight, seen = r["shards"][s]
        torch.testing.assert_close(weight, expect[s::2], rtol=0, atol=0)
        assert sorted((torch.nonzero(seen).flatten() * 2 + s).tolist()) == sorted(
            x for x in (1, 4, 7) if x % 2 == s
        )
    # pushed rows: server 0 owns row 4, server 1 rows 1 and 7 (the replay was sent, not applied)
    assert [c["rows_pushed"] for c in r["counters"]] == [2, 4]


def _server(staleness: int) -> ParamServer:
    spec = TableSpec("t", 4, 2, init_std=1.0)
    shard = EmbeddingShard([spec], 0, 1, RowOptConfig(rule="sgd", lr=1.0), seed=0)
    return ParamServer(0, 1, 2, shard, None, staleness)


def test_bulk_synchronous_push_waits_for_all_workers_and_applies_the_mean():
    ps = _server(0)
    w0 = ps.shard.weight["t"].clone()
    g = torch.ones(1, 2)
    ps.push([("t", torch.tensor([1]), g)], None, worker=0, step=0)
    assert torch.equal(ps.shard.weight["t"], w0) and ps.applied == -1  # buffered, not applied
    ps.push([("t", torch.tensor([1]), 3 * g)], None, worker=1, step=0)
    assert ps.applied == 0
    torch.testing.assert_close(ps.shard.weight["t"][1], w0[1] - 2.0)  # mean of 1 and 3, lr 1
    assert not ps.push([("t", torch.tensor([1]), g)], None, worker=0, step=0)  # replay ignored
    assert ps.resume_step(0) == ps.resume_step(1) == 0


def test_bounded_staleness_blocks_a_worker_too_far_ahead():
    ps = _server(1)
    for w in (0, 1):
        ps.clock(w, 0)
    ps.clock(0, 2)
    done = threading.Event()
    t = threading.Thread(target=lambda: (ps.wait_clock(3, 1), done.set()), daemon=True)
    t.start()  # worker 0 wants step 3 with staleness 1: every worker must have finished step 1
    assert not done.wait(0.3)
    ps.clock(1, 1)
    assert done.wait(5)
    ps.wait_clock(2, 1)  # needs step 0 only: returns at once


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adagrad"])
def test_dense_slices_on_servers_step_like_the_whole_vector(optimizer):
    """S servers each stepping their slice of the flat dense vector = one store stepping all of it
    (the optimisers are elementwise), including a slice that is empty (P < S)."""
    from mariana.platform.ps.dense import DenseStore
    from mariana.platform.ps.shard import contiguous_part

    for total, S in ((1000, 3), (2, 3)):
        spans = [contiguous_part(total, s, S) for s in range(S)]
        assert spans[0][0] == 0 and spans[-1][1] == total
        assert all(spans[s][1] == spans[s + 1][0] for s in range(S - 1))
        g = torch.Generator().manual_seed(0)
        init = torch.randn(total, generator=g)
        whole = DenseStore(init, optimizer, 0.01)
        parts = [DenseStore(init[lo:hi], optimizer, 0.01) for lo, hi in spans]
        for step in range(5):
            grad = torch.randn(total, generator=g)
            assert whole.push(grad, worker=0, step=step)
            for (lo, hi), p in zip(spans, parts, strict=True):
                assert p.push(grad[lo:hi], worker=0, step=step)
        torch.testing.assert_close(torch.cat([p.pull() for p in parts]), whole.pull(), rtol=0, atol=0)
        assert not parts[0].push(grad[spans[0][0] : spans[0][1]], worker=0, step=4)  # a replay: applied once


def test_a_dense_slice_of_another_size_is_refused_with_a_clear_error():
    from mariana.platform.core.errors import MarianaError
    from mariana.platform.ps.dense import DenseStore

    saved = DenseStore(torch.zeros(10), "adam", 0.01).state_dict()
    with pytest.raises(MarianaError, match="dense slice of 10 values where this server holds 5"):
        DenseStore(torch.zeros(5), "adam", 0.01).load_state_dict(saved)
    DenseStore(torch.ones(10), "adam", 0.01).load_state_dict(saved)  # the same size loads
