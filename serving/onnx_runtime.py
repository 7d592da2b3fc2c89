"""``mariana serve --runtime onnxruntime``: an app's model served through ONNX Runtime.

The app's serving loader builds its inference object as for torch (parsing, features, CMVN, decoding and
the answers' form stay the app's); `load` then makes it score through the run's ``model.onnx`` (written by
``mariana export RUN --format onnx``, `mariana.platform.core.onnx_export`) with ``obj.use_onnx``. A
``model.onnx`` exported from other weights than the run's ``model.safetensors`` (trained further, a stream
that exported again) is refused, so both runtimes always serve the same model version.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mariana.platform.core.errors import MarianaError
from mariana.platform.core.onnx_export import ONNX_FILE, ONNX_META, OrtGraph
from mariana.platform.core.registry import AppSpec


def load(spec: AppSpec, run_dir: str) -> Any:
    """``spec``'s inference object for ``run_dir`` scoring through ``RUN/model.onnx``; MarianaError when the
    run has no ONNX model, or one exported from other weights."""
    path, meta = Path(run_dir) / ONNX_FILE, Path(run_dir) / ONNX_META
    if not path.is_file() or not meta.is_file():
        raise MarianaError(f"no {ONNX_FILE} (run `mariana export {run_dir} --format onnx` first)")
    obj = spec.load(run_dir)
    made_from = json.loads(meta.read_text()).get("source_version")
    if made_from != obj.version:
        raise MarianaError(
            f"{path} was exported from model version {made_from}, the run's model is {obj.version}: "
            f"export again (`mariana export {run_dir} --format onnx`)"
        )
    obj.use_onnx(OrtGraph(path))
    return obj
