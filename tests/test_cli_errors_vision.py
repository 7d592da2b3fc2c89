"""Bad input to `mariana vision ...` and `mariana serve` gets one line ``mariana: error: ...`` naming the flag
and what was expected, exit code 2, no traceback, and nothing launched; `serve --port 0` prints the port
it really bound. Everything runs on a few random JPEGs made here and one tiny model trained for one step.
The commands run in this process (`cliwalk.cli`) with CUDA hidden (`no_cuda`, as `helpers.cli_env` hides it
from a subprocess); serving on a port runs as a real process."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from cliwalk import cli
from helpers import assert_cli_error, start_cli, wait_for_line
from PIL import Image


def _hide_cuda(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def no_cuda(monkeypatch):
    """This process without a GPU, as the commands' subprocesses were (CUDA_VISIBLE_DEVICES="")."""
    _hide_cuda(monkeypatch)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"data": folder CLASS/N.jpg (2 classes x 4 images), "run": a vision run trained on it for one step,
    "file": a plain file, "notimg": a .jpg that is text, "root": the folder of all these}."""
    root = tmp_path_factory.mktemp("vision-errors")
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (root / "imgs" / c).mkdir(parents=True)
        for i in range(4):
            pixels = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "imgs" / c / f"{i}.jpg")
    (root / "afile").write_text("not a directory\n")
    (root / "notimg.jpg").write_text("hello\n")
    # a model file exported by another app (only its safetensors metadata matters here)
    from safetensors.torch import save_file

    (root / "pctr-run").mkdir()
    save_file({"w": torch.zeros(2)}, root / "pctr-run" / "model.safetensors", {"mariana": '{"app": "pctr"}'})
    run = root / "run"
    args = ["vision", "train", "--data", root / "imgs", "--out", run, "--preset", "debug", "--limit", "0"]
    with pytest.MonkeyPatch.context() as mp:
        _hide_cuda(mp)
        cli([*args, "--max-steps", "1", "--batch-size", "4", "--no-progress"], check=True)
    return {
        "data": root / "imgs",
        "run": run,
        "file": root / "afile",
        "notimg": root / "notimg.jpg",
        "root": root,
    }


TRAIN = ["vision", "train", "--data", "{data}", "--out", "{root}/out"]
MP2 = ["--workers", "2", "--model-parallel", "2"]
EVAL = ["vision", "eval", "--model", "{run}", "--data", "{data}"]
CLASSIFY = ["vision", "classify", "--model", "{run}", "{data}/cat/0.jpg"]

# (argv, exit code, fragment of the one-line error); {data} {run} {file} {notimg} {root} come from `tiny`
CASES = [
    (TRAIN + ["--micro-batches", "2"], 2, "--micro-batches applies to --model-parallel >= 2 only"),
    (
        TRAIN + ["--pipeline-schedule", "gpipe"],
        2,
        "--pipeline-schedule applies to --model-parallel >= 2 only",
    ),
    (TRAIN + MP2 + ["--compile"], 2, "--compile applies to --model-parallel 1 only"),
    (TRAIN + ["--limit", "-5"], 2, "--limit must be >= 0 images"),
    (TRAIN + ["--eval-data", "{data}", "--eval-limit", "-1"], 2, "--eval-limit must be >= 0"),
    (TRAIN + ["--cache-gb", "0"], 2, "--cache-gb must be > 0"),
    (TRAIN + MP2 + ["--stage-balance", "fast"], 2, "--stage-balance must be params, time or block indices"),
    (TRAIN + MP2 + ["--stage-balance", "3,6"], 2, "--model-parallel 2 needs 1 block index in 1..9"),
    (TRAIN + MP2 + ["--stage-balance", "0"], 2, "in 1..9"),
    (TRAIN + ["--workers", "3", "--model-parallel", "2"], 2, "not divisible by --model-parallel 2"),
    (TRAIN + ["--model", "nosuchnet", "--workers", "2"], 2, "unknown model 'nosuchnet'"),
    (TRAIN + MP2 + ["--model", "densenet121"], 2, "cannot be split into pipeline stages"),
    (TRAIN + ["--augment", "mixup"], 2, "invalid choice: 'mixup'"),
    (TRAIN + ["--preset", "fast"] + MP2, 2, "--recipe fast runs data parallel only (--model-parallel 1)"),
    (TRAIN + ["--recipe", "fast"], 2, "--recipe fast trains --model fastnet only"),
    (
        TRAIN + MP2 + ["--eval-data", "{data}", "--eval-tta", "crops"],
        2,
        "--eval-tta applies to --model-parallel 1 only",
    ),
    (["vision", "train", "--data", "{data}", "--out", "{file}"], 2, "--out {file}"),
    (["vision", "train", "--data", "{data}", "--out", "/proc/mariana-x"], 2, "--out /proc/mariana-x"),
    (["vision", "train", "--data", "{root}/nowhere", "--out", "{root}/o"], 2, "no such file or directory"),
    (EVAL + ["--batch-size", "0"], 2, "--batch-size must be >= 1"),
    (EVAL + ["--num-workers", "-1"], 2, "--num-workers must be >= 0"),
    (["vision", "eval", "--model", "{data}", "--data", "{data}"], 2, "no exported model"),
    (["vision", "eval", "--model", "{root}/none", "--data", "{data}"], 2, "--model {root}/none"),
    (
        ["vision", "eval", "--model", "{root}/pctr-run", "--data", "{data}"],
        2,
        "exported by `mariana pctr train`",
    ),
    (CLASSIFY + ["-k", "0"], 2, "-k must be >= 1"),
    (CLASSIFY + ["-k", "11"], 2, "-k 11: the model knows only 2 classes"),
    (CLASSIFY + ["{notimg}", "{root}/missing.jpg"], 2, "classified 1 of 3 image(s): 2 failed"),
    (CLASSIFY + ["--device", "cuda"], 2, "CUDA is not available"),  # no_cuda hides every GPU
    (["serve"], 2, "nothing to serve"),
    (["serve", "--vision", "{run}", "--port", "70000"], 2, "expected 0..65535"),
]


@pytest.mark.parametrize("argv,code,fragment", CASES, ids=[c[2] for c in CASES])
def test_bad_input_is_one_line_error(tiny, argv, code, fragment, no_cuda, capfd):
    fill = {k: str(v) for k, v in tiny.items()}
    proc = cli([a.format(**fill) for a in argv], capfd)
    assert_cli_error(proc, fragment.format(**fill), code=code)
    assert "launching" not in proc.stderr  # refused before any worker process started
    assert ": error: " in proc.stderr.splitlines()[-1], proc.stderr  # the cause is the last line


def test_eval_writes_one_result_per_data_set(tiny, no_cuda, capfd):
    proc = cli(["vision", "eval", "--model", tiny["run"], "--data", tiny["data"]], capfd, check=True)
    out = tiny["run"] / "eval" / "imgs.json"
    assert f"result written to {out}" in proc.stdout
    assert re.fullmatch(r"top-1 \d+\.\d\d% top-5 100\.00%", proc.stdout.splitlines()[-1])
    assert '"images": 8' in out.read_text()


def _serve(args: list, log: Path):
    """Start `mariana serve ARGS` (`helpers.start_cli`); returns the process and its output's lines up to the
    "serving ..." line."""
    proc = start_cli(["serve", *args], log)
    return proc, wait_for_line(proc, log, "serving ")


def test_serve_port_0_prints_the_bound_port(tiny, tmp_path):
    proc, lines = _serve(["--vision", tiny["run"], "--port", "0", "--threads", "1"], tmp_path / "serve.log")
    try:
        m = re.search(r"on http://127\.0\.0\.1:(\d+)", lines[-1] if lines else "")
        assert m, lines
        port = int(m.group(1))
        assert port > 0
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, lines
                time.sleep(0.2)
        assert r.status_code == 200 and "vision" in r.json()["models"]
    finally:
        proc.terminate()
        proc.wait(20)


def test_serve_busy_port_is_one_line_error(tiny, no_cuda, capfd):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = cli(["serve", "--vision", tiny["run"], "--port", port], capfd)
    assert_cli_error(proc, f"--host 127.0.0.1 --port {port}: cannot bind")
