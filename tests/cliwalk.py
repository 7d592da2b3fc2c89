"""The command-line parser as data, for tests generated over every command: `leaf_parsers` walks
`build_parser` (every app's and the platform's commands) and yields each leaf command with its parser;
`run_main` / `cli` run ``mariana ARGV`` in this process (no interpreter start, no torch import per case),
and put back the process-wide state a command changes, as its own process would have ended with it."""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import random
import signal
import subprocess
from collections.abc import Iterator

import numpy as np
import torch


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


def _logger_state() -> dict[str, tuple]:
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    return {
        lg.name: (lg.handlers[:], lg.level, lg.propagate, lg.disabled)
        for lg in loggers
        if isinstance(lg, logging.Logger)
    }


def _restore_loggers(before: dict[str, tuple]) -> None:
    """Every logger as it was; a handler the command added (``mariana``'s console and RUN/logs files,
    torchrun's launcher.log) is closed, so no later test logs into a closed capture or a deleted run."""
    kept = {id(h) for handlers, *_ in before.values() for h in handlers}
    for name, now in _logger_state().items():
        handlers, level, propagate, disabled = before.get(name, ([], logging.NOTSET, True, False))
        lg = logging.getLogger(name) if name != "root" else logging.getLogger()
        for h in now[0]:
            if id(h) not in kept:
                h.close()
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled


@contextlib.contextmanager
def process_state() -> Iterator[None]:
    """Put back what a ``mariana`` command may change in the process that runs it: environment variables
    (the launcher's run dir and thread counts), the working directory, loggers, torch's thread count and
    flush-denormal mode (``asr train``), cuDNN flags, SIGINT/SIGTERM handlers and the global random
    generators (torch, numpy, random) the command seeds."""
    env, cwd, loggers = dict(os.environ), os.getcwd(), _logger_state()
    threads = torch.get_num_threads()
    cudnn = torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    rng = (torch.random.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        yield
    finally:
        for k in set(os.environ) - set(env):
            del os.environ[k]
        os.environ.update({k: v for k, v in env.items() if os.environ.get(k) != v})
        os.chdir(cwd)
        _restore_loggers(loggers)
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)  # off in a fresh process; the tests never turn it on
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = cudnn
        for sig, h in handlers.items():
            signal.signal(sig, h)
        torch.random.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])


def run_main(argv: list, capsys=None) -> tuple[int, str, str]:
    """``mariana ARGV`` in this process: (exit code, stdout, stderr); argparse's SystemExit counts too.
    Output is read from ``capsys`` (or ``capfd``, which also sees what child processes write), or, without
    one (a module fixture), caught in memory. Any exception other than SystemExit propagates, so a traceback
    fails the test as it would fail the process. The process-wide state is put back (`process_state`)."""
    from mariana.platform.cli.main import main

    if capsys is not None:
        capsys.readouterr()  # what the test printed before is not the command's
    out, err = io.StringIO(), io.StringIO()
    with process_state(), contextlib.ExitStack() as stack:
        if capsys is None:
            stack.enter_context(contextlib.redirect_stdout(out))
            stack.enter_context(contextlib.redirect_stderr(err))
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if capsys is None:
        return rc, out.getvalue(), err.getvalue()
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def cli(argv: list, capsys=None, check: bool = False) -> subprocess.CompletedProcess:
    """`run_main` as the ``CompletedProcess`` that ``helpers.run_cli`` returns (for `helpers.assert_cli_error`);
    ``check=True`` raises with both streams in the message on a non-zero exit, as ``run_cli`` does."""
    rc, out, err = run_main(argv, capsys)
    if check and rc != 0:
        raise AssertionError(f"mariana {' '.join(map(str, argv))} exited {rc}\n--- stdout\n{out[-4000:]}"
                             f"\n--- stderr\n{err[-8000:]}")  # fmt: skip
    return subprocess.CompletedProcess([str(a) for a in argv], rc, out, err)
