import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import helpers  # noqa: E402
from helpers import DATA  # noqa: E402

torch.set_num_threads(1)

# The suite starts a few hundred interpreters (CLI commands, servers, workers) that import the same
# modules; where the environment turns off bytecode caches (PYTHONDONTWRITEBYTECODE) each of them would
# compile the project's sources again, and each xdist worker its assertion-rewritten test files. This
# process (its collection follows) and the ones it starts write and reuse ``__pycache__`` as by default.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

pytest_plugins = ["trained_runs"]  # the trained runs the tests share (session fixtures)


def pytest_collection_modifyitems(config, items):
    # Files holding `slow` tests (training, several processes: up to minutes each) run first, in their
    # collected order, the many quick files after them: with `make test`'s two xdist workers taking one file
    # at a time (`--dist loadfile --no-loadscope-reorder`), the quick files then fill in at the end instead of
    # one worker finishing a minutes-long file alone.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: each file's own order is kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    helpers._base.update(helpers.cli_env())  # what the test zygote starts with (`helpers.zygote_env`)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not DATA.is_dir():
        pytest.fail(f"sample data not found at {DATA} (expected ../shared/data beside the repository)")
    return DATA


@pytest.fixture(autouse=True)
def _no_flush_denormal_leak():
    """`mariana asr train` flushes denormals to zero for its process (apps/asr/train.py); a test that calls
    it in-process must not leave that state behind (hypothesis refuses to draw floats under it)."""
    yield
    torch.set_flush_denormal(False)
