"""Issue 31's house rules, checked on the product code (platform/, apps/, serving/) with an `ast` walk, so
later work cannot undo them: no file over 500 lines, no function over 80 lines, at most 60 function-local
imports of `mariana` modules, no import cycle between packages (the CLI's lazy dispatch,
`platform/cli/dispatch.py`, imports by name at run time and is no `ast` edge); that `mariana --help` imports
neither torch nor numpy is tested in test_cli_help.py.

Issue 40 adds two: no circle of product files importing each other (an edge for every import of a
`mariana` module, function-local ones included, those under ``if TYPE_CHECKING:`` not; ``from pkg import
sub`` is an edge to the submodule, any other import of a package one to its ``__init__.py``), and product
Python under 26,000 lines. Each checker is also run on a small planted tree, to show it catches the fault.

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
# Issue 40: product Python stays under this many lines (`git ls-files 'platform/*.py' 'apps/*.py'
# 'serving/*.py' | xargs cat | wc -l`; 25,531 when the cap was set): new features pay by consolidation.
MAX_PRODUCT_LINES = 26_000


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


def _from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from X import ...`` of ``module`` reads from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute `mariana` module names one import statement of ``module`` names (empty when it imports
    nothing of mariana)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "mariana"]
    target = _from_base(node, module, is_package)
    if target.split(".")[0] != "mariana":
        return []
    if node.module is None:  # ``from . import a, b``: each name is a submodule (or a name of the package)
        return [f"{target}.{a.name}" for a in node.names]
    return [target]


def _imported_files(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]
) -> list[str]:
    """The product modules (keys of `product_files`) one import statement of ``module`` loads, for the
    file-level graph: ``import a.b`` -> ``a.b``; ``from a import n`` -> ``a.n`` when that is a module
    (a submodule), else ``a`` (a package's ``__init__.py``). Namespace folders (no file) are no node."""
    if isinstance(node, ast.Import):
        found = [a.name for a in node.names if a.name in modules]
    else:
        base = _from_base(node, module, is_package)
        found = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    return [m for m in dict.fromkeys(found) if m in modules and m != module]


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): never run, no edge."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                out.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    return out


def _function_bodies(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def measure(root: Path = ROOT) -> dict:
    """-> the figures the rules check: long files, long functions, function-local mariana imports, the
    package import graph (top-level imports and function-local ones alike: both are edges a reader and a
    tool follow), the file import graph ({file: {imported file: "file:line"}}, paths relative to ``root``,
    imports under ``TYPE_CHECKING`` left out) and the product's line count (newlines, as ``wc -l``)."""
    long_files, long_functions, local_imports, edges, file_edges = [], [], [], {}, {}
    files = product_files(root)
    rel_of = {module: path.relative_to(root).as_posix() for module, path in files.items()}
    total_lines = 0
    for module, path in files.items():
        text = path.read_text()
        total_lines += text.count("\n")
        lines = text.count("\n") + (0 if text.endswith("\n") else 1)
        rel = rel_of[module]
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
        never_run = _type_checking_only(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if id(node) not in never_run:
                for target in _imported_files(node, module, is_package, set(files)):
                    file_edges.setdefault(rel, {}).setdefault(rel_of[target], f"{rel}:{node.lineno}")
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
        "file_edges": file_edges,
        "product_lines": total_lines,
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


def cycle_chains(edges: dict[str, dict[str, str]], component: list[str]) -> list[str]:
    """Readable circles through one strongly connected component: the shortest circle through each
    member not yet shown, as ``a.py:3 -> b.py:12 -> a.py`` (each arrow leaves from the import's line)."""
    members, shown, out = set(component), set(), []
    for start in component:
        if start in shown:
            continue
        came_from, queue = {}, [start]
        while queue and start not in came_from:  # breadth first inside the component, back to start
            v = queue.pop(0)
            for w in sorted(edges.get(v, {})):
                if w in members and w not in came_from:
                    came_from[w] = v
                    queue.append(w)
        path, v = [start], came_from[start]
        while v != start:
            path.append(v)
            v = came_from[v]
        path.append(start)
        path.reverse()
        shown.update(path)
        out.append(" -> ".join([edges[a][b] for a, b in zip(path, path[1:])] + [start]))
    return out


def file_circles(figures: dict) -> dict[frozenset[str], list[str]]:
    """-> {the files of one circle: its readable chains} for every file-level import circle."""
    edges = figures["file_edges"]
    return {frozenset(c): cycle_chains(edges, c) for c in import_cycles(edges)}


def line_cap_error(figures: dict, cap: int = MAX_PRODUCT_LINES) -> str | None:
    """The refusal when the product's Python has ``cap`` lines or more (None under the cap)."""
    n = figures["product_lines"]
    if n < cap:
        return None
    return f"product Python is {n} lines (platform/, apps/, serving/), the cap is under {cap}: consolidate"


@pytest.fixture(scope="module")
def figures() -> dict:
    return measure()


def test_no_file_level_import_circle(figures):
    circles = file_circles(figures)
    new = [chain for chains in circles.values() for chain in chains]
    assert not new, (
        "product files that import each other (each arrow leaves from the import's line; imports inside "
        "functions count, those under `if TYPE_CHECKING:` do not):\n  " + "\n  ".join(new)
    )


def test_product_python_under_the_line_cap(figures):
    assert line_cap_error(figures) is None, line_cap_error(figures)


def _plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_file_circle_and_line_cap_checks_see_planted_faults(tmp_path):
    """The checkers on a small synthetic tree: a circle through a submodule import, a function-local
    import and a plain ``import``; a second one through a package's ``__init__.py``; a pair importing each
    other only under ``TYPE_CHECKING`` (no circle); then a file that takes the tree to the line cap."""
    _plant(
        tmp_path,
        {
            "platform/kit/__init__.py": '"""A package."""\nfrom .names import NAME\n',
            "platform/kit/names.py": "from mariana.serving import app\n\nNAME = 1\n",
            "serving/app.py": "from mariana.platform.kit import NAME\n",
            "platform/kit/a.py": "from mariana.platform.kit import b\n",
            "platform/kit/b.py": "def f():\n    from . import c\n",
            "platform/kit/c.py": "import mariana.platform.kit.a\n",
            "apps/d.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .e import X\nY = 1\n",
            "apps/e.py": "from mariana.apps.d import Y\nX = 2\n",
        },
    )
    figures = measure(tmp_path)
    assert file_circles(figures) == {
        frozenset(["platform/kit/a.py", "platform/kit/b.py", "platform/kit/c.py"]): [
            "platform/kit/a.py:1 -> platform/kit/b.py:2 -> platform/kit/c.py:1 -> platform/kit/a.py"
        ],
        frozenset(["platform/kit/__init__.py", "platform/kit/names.py", "serving/app.py"]): [
            "platform/kit/__init__.py:2 -> platform/kit/names.py:1 -> serving/app.py:1 -> platform/kit/__init__.py"
        ],
    }
    assert figures["file_edges"]["apps/e.py"] == {"apps/d.py": "apps/e.py:1"}
    assert "apps/d.py" not in figures["file_edges"]
    _plant(tmp_path, {"platform/kit/b.py": "def f():\n    pass\n"})
    assert list(file_circles(measure(tmp_path))) == [
        frozenset(["platform/kit/__init__.py", "platform/kit/names.py", "serving/app.py"])
    ]

    n = figures["product_lines"]
    assert n == 17  # the newlines of the files above, as `wc -l` counts them
    assert line_cap_error(measure(tmp_path), cap=n + 10) is None
    _plant(tmp_path, {"apps/big.py": "X = 1\n" * 10})
    assert line_cap_error(measure(tmp_path), cap=n + 10) == (
        f"product Python is {n + 10} lines (platform/, apps/, serving/), the cap is under {n + 10}: consolidate"
    )


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
    print(f"product Python: {f['product_lines']} lines (cap: under {MAX_PRODUCT_LINES})")
    circles = file_circles(f)
    print(f"file-level import circles: {len(circles)}")
    for chains in circles.values():
        for chain in chains:
            print(f"   {chain}")
