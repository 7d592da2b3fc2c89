"""The command-line parser as data, for tests generated over every command: `leaf_parsers` walks
`build_parser` (every app's and the platform's commands) and yields each leaf command with its parser."""

from __future__ import annotations

import argparse
from collections.abc import Iterator


def leaf_parsers() -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """``(("pctr", "eval"), parser)`` for every leaf command of ``mariana`` (aliases once)."""
    from mariana.platform.cli.main import build_parser

    def walk(p, path):
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield tuple(path), p
        for a in subs:
            seen = set()
            for name, sp in a.choices.items():
                if id(sp) not in seen:
                    seen.add(id(sp))
                    yield from walk(sp, [*path, name])

    yield from walk(build_parser(), [])


def option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    """The action of ``flag`` in ``parser``, or None."""
    return next((a for a in parser._actions if flag in a.option_strings), None)


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """``mariana ARGV`` in this process: (exit code, stdout, stderr); argparse's SystemExit counts too."""
    from mariana.platform.cli.main import main

    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = int(e.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err
