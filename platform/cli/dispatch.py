"""Lazy command handlers: a parser module names its handler as ``"package.module:function"`` and the
handler module (which imports torch, numpy and the app's training code at its top) is imported only when
that command runs, so ``mariana --help`` and ``mariana APP --help`` import neither torch nor numpy.

This is the one place where the CLI imports product modules lazily (issue 31: imports at the top of every
other module)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable


def handler(target: str) -> Callable[[argparse.Namespace, list[str]], int]:
    """``handler("mariana.apps.pctr.commands:train")`` -> a ``func(args, argv) -> int`` for
    ``parser.set_defaults(func=...)`` that imports ``mariana.apps.pctr.commands`` on its first call and
    runs its ``train(args, argv)``."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"handler target must be 'package.module:function', got {target!r}")

    def run(args: argparse.Namespace, argv: list[str]) -> int:
        return getattr(importlib.import_module(module_name), attr)(args, argv)

    run.__qualname__ = run.__name__ = f"handler[{target}]"
    return run
