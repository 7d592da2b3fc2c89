import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import DATA  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
