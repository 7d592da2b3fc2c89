"""Issue 31.3: ``mariana --help`` and ``mariana APP --help`` import neither torch nor numpy (nor any
command's handler module): the parser modules hold the standard library and the config sections, and the
handlers are imported by `mariana.platform.cli.dispatch` only when their command runs. Checked on the real
entry point with ``python -X importtime``; the planted case shows the check sees a parser module that
imports its handlers at the top. Every lazily wired handler names a function that exists."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from cliwalk import leaf_parsers
from helpers import ROOT, cli_env

HEAVY = ("torch", "numpy")
HANDLER_MODULES = (
    "mariana.apps.asr.commands",
    "mariana.apps.asr.data_commands",
    "mariana.apps.vision.commands",
    "mariana.serving.commands",
)


def imported_modules(code: str) -> set[str]:
    """The modules a fresh interpreter imports while running ``code`` (``-X importtime``'s stderr)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {
        line.rpartition("|")[2].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "argparse" in names, "no -X importtime output: the check would see nothing"
    return names


def help_code(argv: list[str], prelude: str = "") -> str:
    """``mariana ARGV --help`` through the real entry point (`main.run`, as the ``mariana`` script)."""
    return f"{prelude}import sys; sys.argv = ['mariana', *{argv!r}, '--help']; from mariana.platform.cli.main import run; run()"


@pytest.mark.parametrize(
    "argv", [[], ["asr"], ["vision"], ["serve"]], ids=lambda a: " ".join(["mariana", *a])
)
def test_help_imports_neither_torch_nor_numpy(argv):
    names = imported_modules(help_code(argv))
    assert "mariana.platform.cli.main" in names and "mariana.platform.cli.dispatch" in names
    assert not names & {*HEAVY, *HANDLER_MODULES}, sorted(names & {*HEAVY, *HANDLER_MODULES})


def test_the_check_sees_a_parser_module_that_imports_its_handlers():
    """Plant the fault: a parser module importing a handler module at the top (as `asr/cli.py` would with
    ``from .data_commands import prepare``; the data tools, the cheapest handlers to import) pulls numpy
    into ``mariana asr --help``."""
    names = imported_modules(help_code(["asr"], prelude="import mariana.apps.asr.data_commands; "))
    assert "numpy" in names and "mariana.apps.asr.data_commands" in names


def test_every_lazy_handler_names_a_function():
    """A typo in a ``dispatch.handler("module:function")`` target would only fail when that command runs:
    resolve every one of asr, vision and serve here."""
    targets = {}
    for path, p in leaf_parsers():
        func = p.get_default("func")
        name = getattr(func, "__qualname__", "")
        if name.startswith("handler[") and path[0] in ("asr", "vision", "serve"):
            targets[" ".join(path)] = name[len("handler[") : -1]
    assert set(targets) >= {"asr prepare", "asr train", "asr eval", "vision classify", "serve"}, targets
    for command, target in targets.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr, None)), (command, target)
