"""The CPU step's C loops (`mariana.platform.sparse.kernels`, `rows.c`) against the torch ops they replace:
gather and split, distinct rows + per-row gradient sums, the row optimiser; the whole eager step with and
without them over models x row optimisers; bad ids; the fallback when no library can be built."""

from __future__ import annotations

import logging
import platform
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mariana.platform.sparse import kernels as cpu_rows
from mariana.platform.sparse.rules import RowOptConfig, apply_rows, sum_rows
from test_ps_fixed_step import CASES, hashed_batch, make


@pytest.fixture(autouse=True)
def built():
    assert cpu_rows.kernels() is not None, (
        "rows.c did not build: the C compiler is part of the platform's set-up"
    )


def zipf_ids(B=256, F=6, R=500, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ((torch.rand(B, F, generator=g) ** 4 * R).long() + torch.arange(F) * R), F * R


def test_gather_split_equals_embedding_and_its_split():
    ids, R = zipf_ids()
    table = torch.randn(R, 9)
    w0, rest = cpu_rows.gather_split(table, ids, cpu_rows.Scratch(R))
    looked = F.embedding(ids, table)
    assert torch.equal(w0, looked[..., 0]) and torch.equal(rest, looked[..., 1:])


def test_unique_sum_equals_unique_and_index_add_bit_for_bit():
    ids, R = zipf_ids()
    gw, ge = torch.randn(ids.shape), torch.randn(*ids.shape, 8)
    gw[0, 0] = -0.0  # a first occurrence of -0.0 sums to +0.0, as index_add_ into zeros gives
    scratch = cpu_rows.Scratch(R)
    rows, sums = cpu_rows.unique_sum(ids, gw, ge, scratch)
    uniq, inv = torch.unique(ids, return_inverse=True)
    want = torch.cat(
        [
            sum_rows(gw.reshape(-1, 1), inv.reshape(-1), len(uniq)),
            sum_rows(ge.reshape(-1, 8), inv.reshape(-1), len(uniq)),
        ],
        1,
    )
    order = torch.argsort(rows)
    assert len(rows) == len(uniq) < ids.numel()  # repeats were merged
    assert torch.equal(rows[order], uniq) and torch.equal(sums[order], want)
    assert torch.equal(sums[order].signbit(), want.signbit())
    first = torch.tensor([int((ids.reshape(-1) == r).nonzero()[0]) for r in rows])
    assert torch.all(first[1:] > first[:-1])  # in order of first appearance
    assert torch.all(scratch.slot == -1)  # the scratch is clean for the next step


@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
@pytest.mark.parametrize("l2", [0.0, 0.01])
def test_update_rows_equals_apply_rows(rule, l2):
    g = torch.Generator().manual_seed(1)
    table, acc = torch.randn(300, 9, generator=g) * 0.1, torch.rand(300, 9, generator=g)
    rows = torch.randperm(300, generator=g)[:120]
    grad = torch.randn(120, 9, generator=g)
    cfg = RowOptConfig(rule=rule, lr=0.05)
    start = table.clone()
    want_w, want_acc = table.clone(), acc.clone()
    want_grad = grad.clone()
    if l2 > 0:  # the step's torch path: the regulariser added to the row gradients, then the rule
        want_grad.add_(want_w.index_select(0, rows), alpha=l2)
    apply_rows(want_w, {"acc": want_acc}, rows, want_grad, cfg)
    seen = torch.zeros(300, dtype=torch.bool)
    cpu_rows.update_rows(table, acc, seen, rows, grad, rule, cfg.lr, cfg.eps, l2)
    assert torch.equal(grad, want_grad)  # l2 * row added in place, the same bits
    assert torch.equal(acc, want_acc)  # a + g * g, fused as torch's addcmul_ is
    if rule == "sgd":
        assert torch.equal(table, want_w)
    else:  # torch's vectorised sqrt (MKL) may be 1 ulp off; with a correctly rounded one, the same bits
        torch.testing.assert_close(table, want_w, rtol=1e-6, atol=1e-7)
        sqrt = torch.from_numpy(np.sqrt(want_acc.index_select(0, rows).numpy()))
        exact = start.clone()
        exact[rows] = start[rows].sub_(want_grad / (sqrt + cfg.eps), alpha=cfg.lr)
        assert torch.equal(table, exact)
    assert torch.equal(seen, torch.zeros(300, dtype=torch.bool).index_fill_(0, rows, True))


@pytest.mark.parametrize("bad", [-1, 3000])
def test_an_id_outside_the_table_raises_like_embedding(bad):
    ids, R = zipf_ids()
    ids[5, 2] = bad
    with pytest.raises(IndexError, match=f"index {bad} is out of range for a table of {R} rows"):
        cpu_rows.gather_split(torch.zeros(R, 9), ids, cpu_rows.Scratch(R))
    scratch = cpu_rows.Scratch(R)
    with pytest.raises(IndexError, match=f"index {bad} is out of range"):
        cpu_rows.unique_sum(ids, torch.zeros(ids.shape), torch.zeros(*ids.shape, 8), scratch)
    assert torch.all(scratch.slot == -1)


@pytest.mark.parametrize("clip", [0.0, 5.0])
@pytest.mark.parametrize("kind,rule", CASES)
def test_the_eager_step_gives_the_torch_ops_numbers(kind, rule, clip, monkeypatch):
    """Three steps of `SparseStep` (l2_emb on; clipping off: l2 is added inside the row update, on:
    before the norm) with the loops and with torch's ops."""
    out = {}
    for name in ("loops", "torch"):
        if name == "torch":
            monkeypatch.setattr(cpu_rows, "kernels", lambda: None)
        model, fixed, opt = make(kind, rule, trim=True)
        fixed.clip_grad = clip
        losses = []
        for seed in range(3):
            ids, vals, dense, y = hashed_batch(seed=seed)
            fixed.used = fixed.used_parameters(ids[:1], vals[:1], dense[:1])
            params = {f"m.{n}": p.detach() for n, p in model.named_parameters() if n in fixed.names}
            loss, grads = fixed.step(params, ids, vals, dense, y, opt)
            losses.append(loss)
            with torch.no_grad():
                for n, g in zip(fixed.names, grads):
                    if g is not None:
                        params[f"m.{n}"].sub_(0.1 * g)
        assert (getattr(fixed.store, "scratch", None) is not None) == (
            name == "loops"
        )  # each path ran what it names
        out[name] = (torch.stack(losses), fixed.weight.clone(), dict(fixed.state), fixed.seen.clone())
    (la, wa, sa, seen_a), (lb, wb, sb, seen_b) = out["loops"], out["torch"]
    # the same bits but where Adagrad's square root (1 ulp, see above) or clipping's norm (summed over the
    # rows in another order) enters
    tol = {"rtol": 0, "atol": 0} if rule != "adagrad" and clip == 0 else {"rtol": 1e-5, "atol": 1e-7}
    torch.testing.assert_close(la, lb, **tol)
    torch.testing.assert_close(wa, wb, **tol)
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], **tol, msg=k)
    assert torch.equal(seen_a, seen_b) and seen_a.any()


class Records(logging.Handler):
    """The records of the platform's logger (its own handler: the logger does not propagate to the root
    once a CLI in this process has set it up)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record):
        self.seen.append(record.getMessage())


def test_without_the_library_the_step_keeps_torch_ops(tmp_path, monkeypatch):
    # an install without a C compiler leaves no library: one warning naming it, and the torch ops
    monkeypatch.setattr(cpu_rows, "LIBRARY", tmp_path / "no-such.so")
    cpu_rows.kernels.cache_clear()
    records = Records()
    cpu_rows.log.addHandler(records)
    try:
        assert cpu_rows.kernels() is None
        assert not cpu_rows.usable(torch.zeros(4, 3))
        assert len(records.seen) == 1 and "C row kernels unavailable" in records.seen[0]
        assert "no-such.so" in records.seen[0]  # the reason, named
        model, fixed, opt = make("deepfm", "adagrad", trim=True)
        ids, vals, dense, y = hashed_batch()
        loss, _ = fixed(ids, vals, dense, y, opt)
        assert torch.isfinite(loss) and getattr(fixed.store, "scratch", None) is None and fixed.seen.any()
    finally:
        cpu_rows.log.removeHandler(records)
        cpu_rows.kernels.cache_clear()


def test_the_installed_library_is_portable_and_a_stale_one_is_refused(tmp_path, monkeypatch):
    """The library ``pip install -e .`` built (setup.py's extension) carries this rows.c's identity, and each
    loop as an ifunc (its x86-64-v3/v4 clones picked by the CPU at load; no ``-march=native`` build that a
    second CPU generation could not run); a library built from another rows.c is refused at load (kernels()
    None, one warning) rather than called with signatures it does not have."""
    assert cpu_rows.load(cpu_rows.LIBRARY).mariana_rows_source().decode() == cpu_rows.source_id()
    assert "-march=native" not in " ".join(cpu_rows.FLAGS)
    if platform.machine() == "x86_64":
        symbols = subprocess.run(["nm", "-D", str(cpu_rows.LIBRARY)], capture_output=True, text=True).stdout
        for name in cpu_rows.SIGNATURES:
            assert f" i {name}" in symbols, symbols  # an indirect function: the CPU's clone
    stale = tmp_path / "stale.so"
    cc = ["cc", "-shared", "-fPIC", '-DMARIANA_ROWS_SOURCE="0123456789abcdef"', "-o", str(stale)]
    subprocess.run(cc + [str(cpu_rows.SOURCE), "-lm"], check=True)
    with pytest.raises(OSError, match="built from another rows.c"):
        cpu_rows.load(stale)
    monkeypatch.setattr(cpu_rows, "LIBRARY", stale)
    cpu_rows.kernels.cache_clear()
    try:
        assert cpu_rows.kernels() is None
    finally:
        cpu_rows.kernels.cache_clear()
