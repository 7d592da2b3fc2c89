"""Issue 31's house rules, checked on the product code (platform/, apps/, serving/) with an `ast` walk, so
later work cannot undo them: no file over 500 lines, no function over 80 lines, at most 60 function-local
imports of `mariana` modules, no import cycle between packages (the CLI's lazy dispatch,
`platform/cli/dispatch.py`, imports by name at run time and is no `ast` edge); that `mariana --help` imports
neither torch nor numpy is tested in test_cli_help.py.

Run as a script (``python tests/test_house_rules.py``) it prints the measured figures."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Repository folder -> the `mariana` package it is installed as (setup.py's FOLDERS).
FOLDERS = {"platform": "mariana.platform", "apps": "mariana.apps", "serving": "mariana.serving"}
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_LOCAL_IMPORTS = 60


def product_files(root: Path = ROOT) -> dict[str, Path]:
    """-> {dotted module name: path} for every .py file of the product (a package's ``__init__.py`` is the
    package itself)."""
    out = {}
    for folder, prefix in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


def _package_of(module: str) -> str:
    """The package an import edge is counted at: ``mariana.platform.jobs.db`` -> ``mariana.platform.jobs``,
    ``mariana.apps.pctr.ps`` -> ``mariana.apps.pctr``, ``mariana.serving.app`` -> ``mariana.serving``."""
    parts = module.split(".")
    depth = 2 if parts[1] == "serving" else 3
    return ".".join(parts[:depth])


def _imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute `mariana` module names one import statement of ``module`` names (empty when it imports
    nothing of mariana)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "mariana"]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "mariana":
        return []
    if node.module is None:  # ``from . import a, b``: each name is a submodule (or a name of the package)
        return [f"{target}.{a.name}" for a in node.names]
    return [target]


def _function_bodies(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def measure(root: Path = ROOT) -> dict:
    """-> the figures the rules check: long files, long functions, function-local mariana imports, and the
    package import graph (top-level imports and function-local ones alike: both are edges a reader and a
    tool follow)."""
    long_files, long_functions, local_imports, edges = [], [], [], {}
    for module, path in product_files(root).items():
        text = path.read_text()
        lines = text.count("\n") + (0 if text.endswith("\n") else 1)
        rel = path.relative_to(root).as_posix()
        if lines > MAX_FILE_LINES:
            long_files.append((rel, lines))
        tree = ast.parse(text, filename=str(path))
        is_package = path.name == "__init__.py"
        in_function = set()
        for fn in _function_bodies(tree):
            length = fn.end_lineno - fn.lineno + 1
            if length > MAX_FUNCTION_LINES:
                long_functions.append((f"{rel}:{fn.name}", length))
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    in_function.add(id(node))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = _imported_modules(node, module, is_package)
            if targets and id(node) in in_function:
                local_imports.append((rel, node.lineno))
            for target in targets:
                if target.count(".") < 2 and not target.startswith("mariana.serving"):
                    continue  # ``import mariana`` / ``mariana.apps``: a namespace, no package
                src, dst = _package_of(module), _package_of(target)
                if src != dst:
                    edges.setdefault(src, {}).setdefault(dst, f"{rel}:{node.lineno}")
    return {
        "long_files": sorted(long_files, key=lambda x: -x[1]),
        "long_functions": sorted(long_functions, key=lambda x: -x[1]),
        "local_imports": local_imports,
        "edges": edges,
    }


def import_cycles(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan), each sorted: every package in
    one imports every other one, directly or through others."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    nodes = set(edges) | {d for targets in edges.values() for d in targets}

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def figures() -> dict:
    return measure()


def test_no_product_file_over_500_lines(figures):
    assert not figures["long_files"], f"files over {MAX_FILE_LINES} lines: {figures['long_files']}"


def test_no_product_function_over_80_lines(figures):
    assert not figures["long_functions"], (
        f"functions over {MAX_FUNCTION_LINES} lines: {figures['long_functions']}"
    )


def test_few_function_local_imports_of_mariana(figures):
    n = len(figures["local_imports"])
    assert n <= MAX_LOCAL_IMPORTS, (
        f"{n} function-local imports of mariana modules (at most {MAX_LOCAL_IMPORTS})"
    )


def test_no_import_cycle_between_packages(figures):
    edges = figures["edges"]
    cycles = import_cycles(edges)
    where = [
        {src: {dst: edges[src][dst] for dst in edges[src] if dst in c} for src in c if src in edges}
        for c in cycles
    ]
    assert not cycles, f"packages that import each other (package -> package: first import): {where}"


def test_import_cycle_check_sees_a_planted_cycle():
    """The cycle finder on a graph with a planted cycle (a -> b -> c -> a) and a tail (c -> d)."""
    edges = {"a": {"b": ""}, "b": {"c": ""}, "c": {"a": "", "d": ""}}
    assert import_cycles(edges) == [["a", "b", "c"]]
    del edges["c"]["a"]
    assert import_cycles(edges) == []


if __name__ == "__main__":
    f = measure()
    print(f"files over {MAX_FILE_LINES} lines: {len(f['long_files'])}")
    for name, n in f["long_files"]:
        print(f"  {n:5d} {name}")
    print(f"functions over {MAX_FUNCTION_LINES} lines: {len(f['long_functions'])}")
    for name, n in f["long_functions"]:
        print(f"  {n:5d} {name}")
    print(f"function-local imports of mariana modules: {len(f['local_imports'])}")
    per_file: dict[str, int] = {}
    for rel, _ in f["local_imports"]:
        per_file[rel] = per_file.get(rel, 0) + 1
    for rel, n in sorted(per_file.items(), key=lambda x: -x[1]):
        print(f"  {n:4d} {rel}")
    for c in import_cycles(f["edges"]):
        print("cycle:", c)
        for src in c:
            for dst, at in f["edges"].get(src, {}).items():
                if dst in c:
                    print(f"   {src} -> {dst}  ({at})")
