"""Every entry point of the C row loops (`mariana.platform.sparse.kernels`) checks what it is given before it
touches memory: a row outside the table, or a tensor of another dtype or shape than the table's, is a clear
error and the table is unchanged, never a write outside it (issue 42, point 2)."""

from __future__ import annotations

import pytest
import torch
from mariana.platform.sparse import kernels

R, K = 50, 5


@pytest.fixture(autouse=True)
def built():
    assert kernels.kernels() is not None, "the C loops are not built: pip install -e . with a C compiler"


def table():
    g = torch.Generator().manual_seed(0)
    return torch.randn(R, K, generator=g), torch.rand(R, K, generator=g), torch.zeros(R, dtype=torch.bool)


@pytest.mark.parametrize("bad", [-1, R, 10**12])
@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_a_row_outside_the_table_raises_and_writes_nothing(bad, rule):
    weight, acc, seen = table()
    before = weight.clone(), acc.clone()
    rows = torch.tensor([3, 7, bad, 9])  # the bad row after good ones: none of them is written either
    with pytest.raises(IndexError, match=f"row {bad} is out of range for a table of {R} rows"):
        kernels.update_rows(weight, acc, seen, rows, torch.ones(4, K), rule, 0.1, 1e-8)
    assert torch.equal(weight, before[0]) and torch.equal(acc, before[1]) and not seen.any()


@pytest.mark.parametrize(
    "name,change",
    [
        ("acc", lambda a: a.double()),  # the accumulator's dtype
        ("acc", lambda a: a[:, :3].contiguous()),  # its width
        ("acc", lambda a: a[: R // 2]),  # its rows
        ("acc", lambda a: a.t()),  # not contiguous
        ("grad", lambda g: g.double()),
        ("grad", lambda g: g[:, :2].contiguous()),
        ("seen", lambda s: s.to(torch.uint8)),
        ("seen", lambda s: s[:10]),
    ],
)
def test_update_rows_refuses_a_wrong_dtype_or_shape(name, change):
    weight, acc, seen = table()
    args = {"acc": acc, "grad": torch.ones(3, K), "seen": seen}
    args[name] = change(args[name])
    before = weight.clone()
    with pytest.raises(ValueError, match=f"^{name}: .* expected torch.(float32|bool) \\["):
        kernels.update_rows(
            weight, args["acc"], args["seen"], torch.tensor([1, 2, 3]), args["grad"], "adagrad", 0.1, 1e-8
        )
    assert torch.equal(weight, before)


def test_gather_and_unique_sum_refuse_a_wrong_dtype_or_shape():
    weight, _, _ = table()
    ids = torch.tensor([[1, 2], [2, 4]])
    scratch = kernels.Scratch(R)
    with pytest.raises(ValueError, match="^table: torch.float64"):
        kernels.gather_split(weight.double(), ids, scratch)
    with pytest.raises(ValueError, match="^g0: torch.float64"):
        kernels.unique_sum(ids, torch.zeros(2, 2, dtype=torch.float64), torch.zeros(2, 2, K - 1), scratch)
    with pytest.raises(ValueError, match="^g0: torch.float32 \\[3\\]"):
        kernels.unique_sum(ids, torch.zeros(3), torch.zeros(2, 2, K - 1), scratch)
    assert torch.all(scratch.slot == -1)
