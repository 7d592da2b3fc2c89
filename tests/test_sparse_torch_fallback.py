"""The sparse-step, parameter-server and resume tests again on the torch fallback (issue 42, point 2): with
``MARIANA_CPU_KERNELS=off`` every row store, the one-process step's and the servers', runs its torch ops, as
on a machine where the C loops were not built. The files run once more in a pytest subprocess with the
variable set (the servers and workers they start inherit it); the default run covers the C loops.

What it adds to the suite: the chosen files' own time once more (measured in the report of issue 42)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT
from mariana.platform.sparse import kernels
from mariana.platform.sparse.store import CRows, TorchRows, local_store

# the equivalence tests of the step and of the rules, the servers' bit-exact restarts, the resumes
FILES = [
    "tests/test_ps_fixed_step.py",
    "tests/test_pctr_models.py",
    "tests/test_ps_shard.py",
    "tests/test_pctr_resume.py",
    "tests/test_ps_train.py::test_staleness_zero_equals_synchronous_sgd",
    "tests/test_ps_train.py::test_killed_server_restores_last_checkpoint_and_ends_with_the_uninterrupted_model",
]


def test_the_switch_picks_the_torch_store(monkeypatch):
    table, seen = torch.zeros(8, 3), torch.zeros(8, dtype=torch.bool)
    kernels.kernels.cache_clear()
    try:
        if kernels.kernels() is not None:  # on: the C store where the loops apply
            assert type(local_store(table, {}, seen)) is CRows
        monkeypatch.setenv("MARIANA_CPU_KERNELS", "off")
        kernels.kernels.cache_clear()
        assert type(local_store(table, {}, seen)) is TorchRows
    finally:
        kernels.kernels.cache_clear()


@pytest.mark.slow
def test_sparse_step_ps_and_resume_tests_pass_with_the_c_loops_off():
    env = {**os.environ, "MARIANA_CPU_KERNELS": "off"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", *FILES]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
    assert " passed" in p.stdout.splitlines()[-1] and "failed" not in p.stdout.splitlines()[-1]
