"""Model parallel x data parallel through the real launcher (torchrun, gloo, 4 CPU processes).

A 2 x 2 mesh (2 data-parallel groups x 2 pipeline stages) of `mariana vision train` must follow the same
loss curve as one process with the same global batch, all-reduce gradients only among the ranks holding
the same stage, and hold <= 55 % of the unsplit model's parameter + optimizer-state bytes per rank. The
one-process reference goes through the CLI's entry point in this process (`run_main`): no interpreter of
its own, the same parser, config and training code as ``mariana`` in a shell.
"""

from __future__ import annotations

import json

import pytest
import torch
from cliwalk import run_main
from helpers import DATA, last_line, run_cli
from trained_runs import cli_here

pytestmark = pytest.mark.slow

COMMON = [
    "--data",
    DATA / "cifar10" / "train.tar",
    "--model",
    "mariana-cnn-32",
    "--dropout",
    "0",
    "--augment",
    "none",
    "--limit",
    "128",
    "--max-steps",
    "4",
    "--log-every",
    "1",
    "--optimizer",
    "adam",
    "--lr",
    "1e-4",
    "--label-smoothing",
    "0",
    "--no-progress",
    "--seed",
    "3",
    "--device",
    "cpu",
]


def load_init(name: str) -> torch.Tensor:
    """The initial value of parameter ``name`` (same seed and constructor as the training command)."""
    from mariana.apps.vision.model import build_model

    torch.manual_seed(3)
    return build_model("mariana-cnn-32", 10, 32, 0.0).state_dict()[name]


def _losses(run) -> list[float]:
    return [
        r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]


MESH = ["--workers", "4", "--model-parallel", "2", "--batch-size", "8", "--micro-batches", "2"]


def test_2x2_mesh_matches_one_process_and_shards_memory(tmp_path, capsys):
    mesh_run, single_run = tmp_path / "mesh", tmp_path / "single"
    proc = run_cli(["vision", "train", *COMMON, "--out", mesh_run, *MESH], timeout=280)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert last_line(proc.stdout).startswith("train loss")
    rc, _, err = run_main(["vision", "train", *COMMON, "--out", single_run, "--batch-size", "16"], capsys)
    assert rc == 0, err[-6000:]

    # same global batches (2 groups x 8 = 16), same init: the loss curves agree
    mesh_losses, single_losses = _losses(mesh_run), _losses(single_run)
    assert len(mesh_losses) == len(single_losses) == 4
    assert mesh_losses[-1] < mesh_losses[0]  # it trained
    for a, b in zip(mesh_losses, single_losses):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    # ... and so do the trained weights (the mesh's are merged from its stage checkpoints)
    from mariana.platform.core.export import load_exported

    w_mesh, _ = load_exported(mesh_run)
    w_single, _ = load_exported(single_run)
    assert w_mesh.keys() == w_single.keys()
    for name, w in w_mesh.items():
        torch.testing.assert_close(w, w_single[name], atol=1e-5, rtol=1e-4, msg=name)
    changed = [n for n, w in w_mesh.items() if not torch.equal(w, load_init(n))]
    assert changed, "training did not change the weights"

    # gradient groups: exactly the ranks that hold the same stage
    reports = {r: json.loads((mesh_run / "logs" / f"pipeline-rank-{r}.json").read_text()) for r in range(4)}
    for r, rep in reports.items():
        assert rep["n_stages"] == 2
        assert r in rep["dp_ranks"] and len(rep["dp_ranks"]) == 2
        assert {reports[q]["stage"] for q in rep["dp_ranks"]} == {rep["stage"]}
        assert {reports[q]["stage"] for q in rep["mp_ranks"]} == {0, 1}
    assert {reports[r]["stage"] for r in range(4)} == {0, 1}

    # memory: parameters + Adam state per rank vs the unsplit model with the same optimizer
    from mariana.apps.vision.model import mariana_cnn_32
    from mariana.platform.pipeline import optimizer_state_bytes, param_bytes

    full = mariana_cnn_32(10, 0.0)
    opt = torch.optim.Adam(full.parameters(), lr=1e-4)
    full(torch.randn(2, 3, 32, 32)).sum().backward()
    opt.step()
    full_bytes = param_bytes(full) + optimizer_state_bytes(opt)
    for rep in reports.values():
        assert rep["optimizer_state_bytes"] == 2 * rep["param_bytes"]  # Adam moments really exist
        ratio = (rep["param_bytes"] + rep["optimizer_state_bytes"]) / full_bytes
        assert ratio <= 0.55, (rep["rank"], ratio)

    # the exported model is the whole network, assembled from the stage checkpoints
    from mariana.apps.vision.predict import load_classifier

    clf = load_classifier(mesh_run)
    assert sum(p.numel() for p in clf.model.parameters()) == sum(p.numel() for p in full.parameters())
    metrics = json.loads((mesh_run / "metrics.json").read_text())
    assert metrics["model_parallel"] == 2 and metrics["data_parallel"] == 2

    # --resume: 2 steps, then resume to 4 from the per-stage checkpoints (weights, Adam state, data
    # position) gives the uninterrupted run's losses and weights
    resumed = tmp_path / "resumed"
    args = ["vision", "train", *COMMON, "--out", resumed, *MESH]
    run_cli([*args, "--max-steps", "2"], timeout=280, check=True)
    assert sorted(p.name for p in (resumed / "checkpoints" / "step_00000002").glob("stage-*.pt")) == [
        "stage-0.pt",
        "stage-1.pt",
    ]
    proc = run_cli([*args, "--resume"], timeout=280, check=True)
    assert "resumed from step 2" in proc.stderr
    assert _losses(resumed) == pytest.approx(mesh_losses, rel=1e-6, abs=1e-7)
    w_resumed, _ = load_exported(resumed)
    for name, w in w_mesh.items():
        torch.testing.assert_close(w_resumed[name], w, atol=1e-6, rtol=1e-6, msg=name)


def test_model_parallel_must_divide_workers(tmp_path):
    proc = cli_here(  # refused by the launching process, before torchrun starts
        ["vision", "train", *COMMON, "--out", tmp_path / "r", "--workers", "3", "--model-parallel", "2"]
    )
    assert proc.returncode == 2
    assert "not divisible by --model-parallel 2" in proc.stderr
