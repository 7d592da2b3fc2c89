"""``mariana export RUN --format onnx``: a run's exported model as ONNX, checked, and compared with torch.

Writes ``RUN/model.onnx`` and ``RUN/model.onnx.json`` (platform/README.md, ONNX). The app's inference
object (`AppSpec.load`) says what the graph is: ``obj.onnx_graph(batch, gen) -> (module, {input name:
example tensor}, output name, {input name: {axis: axis name}})``; ``obj.use_onnx(fn)`` makes it score
through ``fn(*inputs)`` instead (`mariana.serving.onnx_runtime`). torch's dynamo exporter is used because
it keeps every input (the TorchScript one drops libFM pCTR models' empty ``dense``); nothing is written
unless ``onnx.checker`` passes and ONNX Runtime matches torch on held-out inputs within
``|ort - torch| <= atol + rtol * |torch|``.
"""

from __future__ import annotations

import hashlib
import json
from importlib.metadata import version
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from . import jsonfile
from .atomic import atomic_write_path, atomic_write_text
from .errors import MarianaError
from .registry import get_app

ONNX_FILE, ONNX_META = "model.onnx", "model.onnx.json"
OPSET = 18


def file_digest(path: Path) -> str:
    """The first 16 hex digits of the file's SHA-256."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]


class OrtGraph:
    """``graph(*inputs) -> output``: torch tensors in the graph's input order -> its output as a CPU torch
    tensor, run by an ONNX Runtime session on as many threads as torch uses (what ``obj.use_onnx`` takes)."""

    def __init__(self, path: str | Path):
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = torch.get_num_threads(), 1
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.session.get_inputs()]

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        feeds = {n: t.detach().cpu().numpy() for n, t in zip(self.names, inputs, strict=True)}
        return torch.from_numpy(self.session.run(None, feeds)[0])


def _export(module: torch.nn.Module, example: dict, output: str, axes: dict, path: str) -> None:
    dims: dict[str, torch.export.Dim] = {}
    shapes = tuple(
        {i: dims.setdefault(n, torch.export.Dim(n)) for i, n in axes.get(k, {}).items()} for k in example
    )
    torch.onnx.export(
        module.eval(), tuple(example.values()), path, input_names=list(example), output_names=[output],
        dynamic_shapes=shapes, opset_version=OPSET, dynamo=True, verbose=False,
    )  # fmt: skip
    onnx.checker.check_model(onnx.load(path), full_check=True)


def _compare(obj, module: torch.nn.Module, path: str, atol: float, rtol: float) -> dict:
    """ONNX Runtime vs torch on held-out inputs (batch 3, another seed): their shapes and the largest
    difference; MarianaError when outside the tolerance."""
    held, output = obj.onnx_graph(3, torch.Generator().manual_seed(1))[1:3]
    with torch.no_grad():
        got, want = OrtGraph(path)(*held.values()).numpy(), module(*held.values()).float().numpy()
    diff = float(np.abs(got - want).max()) if want.size else 0.0
    if got.shape != want.shape or not np.allclose(got, want, rtol=rtol, atol=atol):
        raise MarianaError(
            f"onnxruntime's {output} differs from torch's by {diff:.3g} (> atol {atol}, rtol {rtol})"
        )
    return {
        "inputs": {k: list(v.shape) for k, v in held.items()},
        "max_abs_diff": diff,
        "atol": atol,
        "rtol": rtol,
    }


def export_onnx(run_dir: str | Path, atol: float = 1e-5, rtol: float = 1e-5) -> dict:
    """Write ``RUN/model.onnx`` + ``RUN/model.onnx.json`` from the run's exported model (see the module);
    returns what the JSON holds. MarianaError (one line) for a run without a model or an app without a graph."""
    run = Path(run_dir)
    try:
        app = json.loads((run / "model.json").read_text())["app"]
    except (OSError, ValueError, KeyError, TypeError):
        raise MarianaError(
            f"{run}: no exported model (model.json; train first, or give the run directory)"
        ) from None
    obj = get_app(app).load(str(run))
    if not callable(getattr(obj, "onnx_graph", None)):
        raise MarianaError(f"{run}: {app} models have no ONNX graph")
    module, example, output, axes = obj.onnx_graph(2, torch.Generator().manual_seed(0))
    check: dict = {}

    def write(tmp: str) -> None:
        _export(module, example, output, axes, tmp)
        check.update(_compare(obj, module, tmp, atol, rtol))

    path = atomic_write_path(run / ONNX_FILE, write)
    info = {
        "app": app, "source_version": obj.version, "digest": file_digest(path), "opset": OPSET,
        "inputs": {k: [axes.get(k, {}).get(i, n) for i, n in enumerate(v.shape)] for k, v in example.items()},
        "output": output, "exporter": "torch.onnx.export(dynamo=True)", "check": check,
        "versions": {d: version(d) for d in ("torch", "onnx", "onnxscript", "onnxruntime")},
    }  # fmt: skip
    atomic_write_text(run / ONNX_META, jsonfile.dumps(info, indent=2) + "\n")
    return info


def command(args, argv) -> int:
    """``mariana export RUN --format onnx``: prints where the model went and the comparison, last."""
    info = export_onnx(args.run, args.atol, args.rtol)
    c = info["check"]
    print(
        f"wrote {Path(args.run) / ONNX_FILE} ({info['app']} model {info['source_version']}, opset {info['opset']}, "
        f"digest {info['digest']}); onnxruntime = torch on held-out {c['inputs']}: max |diff| {c['max_abs_diff']:.3g}"
    )
    return 0
