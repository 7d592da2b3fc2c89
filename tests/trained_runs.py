"""Trained runs the tests share, built once per pytest worker (session fixtures; conftest.py registers
this module as a plugin), and the in-process CLI call that builds them.

A run is made by the CLI's own `main` in the test process, with the argv a test would type: no interpreter
start-up and no second `import torch` (about 2.5 s of the ~4 s a tiny training subprocess takes), and
exactly what `helpers.run_cli` would train: one torch thread (conftest.py) and no CUDA device
(`helpers.cli_env` hides it from a subprocess; `cli_in_process` from the command), so a run built here and
one a test trains as a subprocess agree to the bit. A test that only reads a run (serves it, warm-starts
another --out from it, loads it) takes ``run.path``; one that writes into it (``eval`` results, --resume,
--force, a reload of edited files) takes `fresh_copy`."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
from cliwalk import cli, run_main
from helpers import CHILD_ENV, DATA

FRAPPE = DATA / "frappe" / "frappe.validation.libfm"
CRITEO = DATA / "criteo" / "criteo_sample.tsv"

# A DeepFM on the whole Frappe sample, 60 steps evaluated every 20 (the exported model is the best
# evaluation's), with dropout layers (they shift the MLP's indices: every loader must agree): the round
# trip train -> eval -> predict, the model the serving tests serve, and the source of a pCTR warm start.
FRAPPE_DEEPFM = [
    "pctr", "train", "--data", FRAPPE, "--format", "libfm", "--model", "deepfm", "--preset", "debug",
    "--max-steps", "60", "--eval-every", "20", "--hidden", "16,8", "--dropout", "0.2", "--no-progress",
]  # fmt: skip
# Another model of the same data (an FM, the debug preset's 20 steps): the other version in reload tests.
FRAPPE_FM = ["pctr", "train", "--data", FRAPPE, "--format", "libfm", "--preset", "debug", "--model", "fm"]
# A DCN on the Criteo sample (dense + hashed categorical fields), the debug preset's 20 steps.
CRITEO_DCN = ["pctr", "train", "--data", CRITEO, "--format", "criteo", "--preset", "debug", "--model", "dcn"]


@dataclass(frozen=True)
class Trained:
    """A finished command's output folder (``--out``) and what it printed."""

    path: Path
    stdout: str
    stderr: str


@contextlib.contextmanager
def as_subprocess(env: dict[str, str] | None = None) -> Iterator[None]:
    """An in-process command as `helpers.run_cli` runs one: no CUDA device, and the environment of a CLI
    subprocess (`helpers.CHILD_ENV`, then ``env``) for the processes it starts (`asr eval --loso`'s folds)."""
    with (
        mock.patch.object(torch.cuda, "is_available", return_value=False),
        mock.patch.dict(os.environ, {**CHILD_ENV, **(env or {})}),
    ):
        yield


def cli_in_process(argv: list) -> tuple[int, str, str]:
    """``mariana ARGV`` run by `cliwalk.run_main` in this process `as_subprocess`: (exit code, stdout,
    stderr). The process state the command changes (loggers and their handlers, env, threads,
    flush-denormal, RNG) is put back afterwards."""
    with as_subprocess():
        return run_main(argv)


def cli_here(
    argv: list, check: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`cliwalk.cli` `as_subprocess` (``env`` added): ``helpers.run_cli``'s drop-in for a one-process
    command whose exit code, output and files a test reads (signals, pipes and terminals stay real
    processes' tests)."""
    with as_subprocess(env):
        return cli(argv, check=check)


def run_ok(argv: list) -> tuple[str, str]:
    """`cli_in_process` that must exit 0 (else an AssertionError with the output): (stdout, stderr)."""
    rc, stdout, stderr = cli_in_process(argv)
    shown = f"--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-8000:]}"
    assert rc == 0, f"mariana {' '.join(map(str, argv))} exited {rc}\n{shown}"
    return stdout, stderr


def train(argv: list, out: Path) -> Trained:
    """``argv --out OUT`` in this process (`run_ok`). Also for the commands that make a folder without
    training (``asr prepare``)."""
    return Trained(Path(out), *run_ok([*argv, "--out", out]))


def fresh_copy(run: Trained | Path, dest: Path) -> Path:
    """A copy of a shared run at ``dest`` (which must not exist) for a test that writes into the run."""
    shutil.copytree(run.path if isinstance(run, Trained) else run, dest, symlinks=True)
    return dest


def _shared(tmp_path_factory, name: str, argv: list) -> Trained:
    return train(argv, tmp_path_factory.mktemp("trained-runs") / name)


@pytest.fixture(scope="session")
def frappe_deepfm(tmp_path_factory) -> Trained:
    """`FRAPPE_DEEPFM`, trained once per worker."""
    return _shared(tmp_path_factory, "frappe-deepfm", FRAPPE_DEEPFM)


@pytest.fixture(scope="session")
def frappe_fm(tmp_path_factory) -> Trained:
    """`FRAPPE_FM`, trained once per worker."""
    return _shared(tmp_path_factory, "frappe-fm", FRAPPE_FM)


@pytest.fixture(scope="session")
def criteo_dcn(tmp_path_factory) -> Trained:
    """`CRITEO_DCN`, trained once per worker."""
    return _shared(tmp_path_factory, "criteo-dcn", CRITEO_DCN)
