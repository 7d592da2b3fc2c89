"""`rowopt.sum_rows`: the per-row gradient sum of the sparse steps is ``index_add_``'s, bit for bit."""

import pytest
import torch
from mariana.platform.ps.rowopt import sum_rows


@pytest.mark.parametrize("threads", [1, 2])
def test_sum_rows_equals_index_add_bit_for_bit(threads):
    """Power-law indices (many repeats, some rows never named) at the CPU step's sizes, 1 and 2 threads:
    the same bits as ``zeros.index_add_`` (the gradients' summation order per row is the index order)."""
    g = torch.Generator().manual_seed(0)
    index = ((torch.rand(20_000, generator=g) ** 4) * 5_000).long()
    grad = torch.randn(20_000, 17, generator=g) * 1e3  # large values: any reordering would change bits
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = sum_rows(grad, index, 5_000)
    finally:
        torch.set_num_threads(before)
    want = torch.zeros(5_000, 17).index_add_(0, index, grad)
    assert torch.equal(got, want)
    assert int((got.abs().sum(1) == 0).sum()) == 5_000 - index.unique().numel()  # unnamed rows: zeros
