"""Lazy command handlers: a parser module names its handler as ``"package.module:function"`` and the
handler module (which imports torch, numpy and the app's training code at its top) is imported only when
that command runs, so ``mariana --help`` and ``mariana APP --help`` import neither torch nor numpy. A handler
takes the parsed flags and the argv, prints its result lines and returns the exit code; bad input raises
`MarianaError` (one line, exit 2).

This is the one place where the CLI imports product modules lazily (issue 31: imports at the top of every
other module)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

from ..core.errors import MarianaError


def handler(target: str) -> Callable[[argparse.Namespace, list[str]], int]:
    """``handler("mariana.apps.pctr.commands:train")`` -> a ``func(args, argv) -> int`` for
    ``parser.set_defaults(func=...)`` that imports ``mariana.apps.pctr.commands`` on its first call and
    runs its ``train(args, argv)``."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"handler target must be 'package.module:function', got {target!r}")

    def run(args: argparse.Namespace, argv: list[str]) -> int:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:  # an optional extra (onnx, ...) that is not installed: one line
            if (e.name or "mariana").startswith("mariana"):
                raise
            raise MarianaError(f"this command needs the package {e.name!r} (an extra: pyproject.toml)") from e
        return getattr(module, attr)(args, argv)

    run.__qualname__ = run.__name__ = f"handler[{target}]"
    return run
