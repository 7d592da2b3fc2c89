"""The parameter-server framework's layout (issue 32): `platform/ps` is the framework, `apps/pctr` the
application on it. An ast walk over the sources (no imports, milliseconds):

- `apps/pctr` imports nothing from ``torch.distributed`` (RPC is the framework's business);
- `platform/ps` imports nothing from ``mariana.apps``;
- the parameter-server step classes, the pull-ahead loader and the server checkpointer are defined under
  `platform/ps`, the one-process step (`LocalStep`, issue 42) under `platform/sparse`;
- `platform/ps/server.py` (and the stream's coordinator) reach their objects without forwarding functions
  to a module global (``def _pull(*a): return _PS.pull(*a)``) or ``global`` rebinding.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORK_CLASSES = {"PSWorkerStep", "PullAheadLoader", "ServerCheckpointer"}
SPARSE_CLASSES = {"LocalStep", "SparseStep"}  # issue 42: the one-process step left platform/ps


def _trees(folder: Path) -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(folder.rglob("*.py"))}


def _imported_modules(path: Path, tree: ast.Module, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, function-local ones included;
    ``package``: the file's package, to resolve relative imports."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def imports_matching(folder: Path, package: str, prefix: str) -> list[str]:
    """``file:line module`` for each import under ``folder`` of ``prefix`` or a module inside it."""
    bad = []
    for path, tree in _trees(folder).items():
        for line, mod in _imported_modules(path, tree, package):
            if mod == prefix or mod.startswith(prefix + "."):
                bad.append(f"{path.relative_to(folder.parent.parent)}:{line} {mod}")
    return bad


def classes_defined(folder: Path) -> set[str]:
    return {n.name for t in _trees(folder).values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}


def forwarders(path: Path) -> list[str]:
    """Module-level functions of ``path`` that only call a method of a module-level variable (or rebind
    one with ``global``)."""
    tree = ast.parse(path.read_text(), str(path))
    module_vars = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        module_vars |= {t.id for t in targets if isinstance(t, ast.Name)}
    bad = []
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if any(isinstance(n, ast.Global) for n in ast.walk(fn)):
            bad.append(f"{fn.name} (global)")
        calls = [s.value for s in body[:1] if isinstance(s, (ast.Return, ast.Expr))]
        if len(body) == 1 and calls and isinstance(calls[0], ast.Call):
            f = calls[0].func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in module_vars:
                bad.append(f"{fn.name} -> {f.value.id}.{f.attr}")
    return bad


def check_layout(root: Path) -> list[str]:
    """Every violation of the layout under ``root`` (a checkout), as lines."""
    pctr, ps = root / "apps" / "pctr", root / "platform" / "ps"
    problems = [
        f"torch.distributed in apps/pctr: {b}"
        for b in imports_matching(pctr, "mariana.apps.pctr", "torch.distributed")
    ]
    problems += [
        f"mariana.apps in platform/ps: {b}"
        for b in imports_matching(ps, "mariana.platform.ps", "mariana.apps")
    ]
    missing = FRAMEWORK_CLASSES - classes_defined(ps)
    problems += [f"{c} is not defined under platform/ps" for c in sorted(missing)]
    sparse = root / "platform" / "sparse"
    missing = SPARSE_CLASSES - (classes_defined(sparse) if sparse.is_dir() else set())
    problems += [f"{c} is not defined under platform/sparse" for c in sorted(missing)]
    problems += [
        f"{c} is still defined under platform/ps" for c in sorted(SPARSE_CLASSES & classes_defined(ps))
    ]
    problems += [
        f"{c} is still defined in apps/pctr"
        for c in sorted((FRAMEWORK_CLASSES | SPARSE_CLASSES) & classes_defined(pctr))
    ]
    for path in [ps / "server.py", *(p for p in [pctr / "streams" / "servers.py"] if p.is_file())]:
        problems += [f"forwarding function in {path.relative_to(root)}: {f}" for f in forwarders(path)]
    return problems


def test_parameter_server_framework_layout():
    assert check_layout(ROOT) == []


def test_the_walk_sees_each_kind_of_violation(tmp_path):
    """Plant one of each violation in a copy of the layout: each is reported."""
    pctr, ps = tmp_path / "apps" / "pctr", tmp_path / "platform" / "ps"
    pctr.mkdir(parents=True)
    ps.mkdir(parents=True)
    (pctr / "ps.py").write_text("def f():\n    from torch.distributed import rpc\n\nclass LocalStep: ...\n")
    (ps / "step.py").write_text(
        "from ...apps.pctr.model import CTRModel\n\nclass PSWorkerStep: ...\nclass PullAheadLoader: ...\n"
        "class SparseStep: ...\n"
    )
    (ps / "server.py").write_text(
        '_PS = None\n\ndef _pull(*a):\n    """doc"""\n    return _PS.pull(*a)\n\n'
        "def install(s):\n    global _PS\n    _PS = s\n\ndef fine(x):\n    return x.pull()\n"
    )
    got = "\n".join(check_layout(tmp_path))
    assert "torch.distributed in apps/pctr: apps/pctr/ps.py:2" in got
    assert "mariana.apps in platform/ps: platform/ps/step.py:1 mariana.apps.pctr.model" in got
    assert "ServerCheckpointer is not defined under platform/ps" in got
    assert (
        "LocalStep is not defined under platform/sparse" in got
        and "LocalStep is still defined in apps/pctr" in got
        and "SparseStep is still defined under platform/ps" in got
    )
    assert "_pull -> _PS.pull" in got and "install (global)" in got and ": fine" not in got
