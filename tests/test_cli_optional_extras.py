"""A command whose optional extra is not installed (``mariana export --format onnx`` without ``onnx``) ends
with one line naming the package, exit 2, not a traceback (issue 44: the extras are optional)."""

from __future__ import annotations

import sys

from cliwalk import run_main


def test_export_without_onnx_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.delitem(sys.modules, "mariana.platform.core.onnx_export", raising=False)
    monkeypatch.setitem(sys.modules, "onnx", None)  # `import onnx` raises ModuleNotFoundError(name="onnx")
    rc, out, err = run_main(["export", str(tmp_path), "--format", "onnx"], capsys)
    assert rc == 2, (out, err)
    assert "Traceback" not in err and "needs the package 'onnx'" in err, err
    assert len(err.strip().splitlines()) == 1, err
