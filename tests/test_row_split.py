"""One row-split rule (issue 31): `mariana.platform.data.splits.split_bounds` is what pCTR and the mlp app
split by, in training and in ``eval --split``."""

from __future__ import annotations

import numpy as np
import pytest
from mariana.apps.mlp import data as mlp_data
from mariana.apps.mlp import evaluate as mlp_evaluate
from mariana.apps.pctr.data import reader as pctr_data
from mariana.apps.pctr.data import reader as pctr_reader
from mariana.platform.core.errors import DataError
from mariana.platform.data.splits import split_bounds, tail_fractions


def test_both_click_apps_split_with_the_platforms_rule():
    for module in (pctr_data, pctr_reader, mlp_data, mlp_evaluate):  # pctr eval splits by its reader
        assert module.split_bounds is split_bounds  # no second rule beside it


@pytest.mark.parametrize("n", [10, 57722, 1005])
def test_mlp_split_rows_are_the_rules_ranges(n):
    labels, ids = np.arange(n, dtype=np.float32), np.zeros((n, 10), dtype=np.int64)
    train, val = mlp_data.split(labels, ids, 0.1, 1000, 0.1)
    b = split_bounds(n, tail_fractions(0.1, 0.1))
    assert train.labels.tolist() == list(range(*b["train"]))
    assert val.labels.tolist() == list(range(*b["val"]))


def test_the_demo_split_is_unchanged():
    # Frappe's validation file (57722 rows) with the defaults of both apps: mlp --val-fraction 0.1
    # --test-fraction 0.1 and pctr --split 0.8,0.1,0.1 (the rows the demo trains and evaluates on).
    assert split_bounds(57722, tail_fractions(0.1, 0.1)) == split_bounds(57722, (0.8, 0.1, 0.1))
    assert split_bounds(57722, (0.8, 0.1, 0.1))["val"] == (46178, 51950)


def test_a_split_without_validation_rows_is_refused():
    with pytest.raises(DataError, match="none to validate on"):
        mlp_data.split(np.zeros(4, dtype=np.float32), np.zeros((4, 10), dtype=np.int64), 0.1, 100, 0.0)
