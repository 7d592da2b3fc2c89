"""The ``--help`` of every command (``mariana``, every group, every leaf command), in one place.

Its text (in this process, `cliwalk.cli`): exit 0 and the usage, no ``(default: None)`` or
``(default: '')`` on a flag without a default, the choices of the flags listed in HELP_SHOWS, and none of the
flags an app does not use (HELP_HIDES: issue 30.3).

Its imports (issue 31.3): neither torch nor numpy (nor any command's handler module): the parser modules hold
the standard library and the config sections, and the handlers are imported by
`mariana.platform.cli.dispatch` only when their command runs. Checked on the real entry point
(``python -m mariana.platform.cli``, run by `runpy` as the interpreter does) in ONE fresh interpreter for
all the commands: after each ``--help`` the script records the modules imported since the previous one (the
first: every module of the interpreter), so a command that pulls in torch is named. The planted case shows
the check sees a parser module that imports its handlers at the top. Every lazily wired handler names a
function that exists."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
from cliwalk import cli, leaf_parsers
from helpers import ROOT, cli_env

HEAVY = ("torch", "numpy")
LEAVES = [path for path, _ in leaf_parsers()]
# the bare command, every group (``mariana pctr``) and every leaf command (``mariana pctr train``)
COMMANDS = [[]] + [list(c) for c in sorted({p[:n] for p in LEAVES for n in range(1, len(p) + 1)})]
HANDLER_TARGETS = {
    " ".join(path): getattr(p.get_default("func"), "__qualname__", "")[len("handler[") : -1]
    for path, p in leaf_parsers()
    if getattr(p.get_default("func"), "__qualname__", "").startswith("handler[")
}
HANDLER_MODULES = {
    "mariana.apps.asr.commands",
    "mariana.apps.asr.data_commands",
    "mariana.apps.vision.commands",
    "mariana.serving.commands",
} | {target.partition(":")[0] for target in HANDLER_TARGETS.values()}

# what a command's help must show (the choices of its flags), and the flags of other apps it must not offer
HELP_SHOWS = {
    ("mlp", "train"): ["--preset {debug,small}", "--optimizer {sgd,adam,adamw}"],
    ("asr", "eval"): ["{speaker,file}"],
    ("vision", "train"): ["--preset {debug,fast,gpu94,small}", "{flip-crop,flip,none,alt-flip-translate}"],
    ("vision", "eval"): ["--device {auto,cpu,cuda}"],
    ("vision", "classify"): ["--device {auto,cpu,cuda}"],
    ("serve",): ["{critical,error,warning,info,debug}"],
    ("pctr", "train"): [
        *("--schedule", "--warmup-steps", "--clip-grad", "--eval-every", "--ckpt-every", "--resume"),
        *("--weight-decay", "--l2-emb"),
    ],
}
HELP_HIDES = {("pctr", "train"): ["--grad-comm", "--grad-accum", "--momentum", "--num-workers"]}


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(["mariana", *a, "--help"]))
def test_help_text(argv, capsys):
    p = cli([*argv, "--help"], capsys)
    text = " ".join(p.stdout.split())  # argparse wraps lines
    assert p.returncode == 0 and "usage: mariana" in p.stdout, p.stderr
    assert "(default: None)" not in text and "(default: '')" not in text, p.stdout
    for shown in HELP_SHOWS.get(tuple(argv), []):
        assert shown in p.stdout, shown
    for hidden in HELP_HIDES.get(tuple(argv), []):
        assert hidden not in p.stdout, hidden


def test_help_fragments_name_real_commands():
    assert {*HELP_SHOWS, *HELP_HIDES} <= {tuple(c) for c in COMMANDS}


# Runs in the fresh interpreter: argv lists in sys.argv[1] (JSON); prints one JSON line per command.
SCRIPT = """
import contextlib, io, json, runpy, sys
seen = set()
for argv in json.loads(sys.argv[1]):
    sys.argv = ["mariana", *argv, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module("mariana.platform.cli", run_name="__main__", alter_sys=True)
            code = None
        except SystemExit as e:
            code = e.code
    new = sorted(set(sys.modules) - seen)
    seen |= set(sys.modules)
    print(json.dumps({"argv": argv, "code": code, "usage": "usage: mariana" in out.getvalue(), "new": new}))
"""


def help_imports(commands: list[list[str]], prelude: str = "") -> dict[str, dict]:
    """``mariana CMD --help`` for each of ``commands`` in turn in one fresh interpreter (after ``prelude``,
    Python code): {"CMD": {"code": exit code, "usage": help printed, "new": modules first imported by it}}."""
    proc = subprocess.run(
        [sys.executable, "-c", prelude + SCRIPT, json.dumps(commands)],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["argv"] for r in rows] == commands, proc.stdout[-3000:]
    return {" ".join(r["argv"]): r for r in rows}


@pytest.fixture(scope="module")
def helps() -> dict[str, dict]:
    return help_imports(COMMANDS)


def test_the_commands_cover_every_app_and_platform_command():
    from mariana.platform.core.registry import all_apps

    tops = {path[0] for path in COMMANDS if path}
    assert tops >= {spec.name for spec in all_apps()} | {"jobs", "tune", "serve", "submit"}, tops
    assert {("pctr", "train"), ("pctr", "stream"), ("mlp", "train")} <= {tuple(p) for p in COMMANDS}


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(["mariana", *a, "--help"]))
def test_help_imports_neither_torch_nor_numpy(argv, helps):
    row = helps[" ".join(argv)]
    assert row["code"] == 0 and row["usage"], row  # the help was printed, not only the modules imported
    if not argv:  # the first command: every module of the interpreter, the CLI's own among them
        assert {"mariana.platform.cli.main", "mariana.platform.cli.dispatch", "argparse"} <= set(row["new"])
    bad = set(row["new"]) & {*HEAVY, *HANDLER_MODULES}
    assert not bad, f"`mariana {' '.join(argv)} --help` imports {sorted(bad)}"


def test_the_check_sees_a_parser_module_that_imports_its_handlers():
    """Plant the fault: a parser module importing a handler module at the top (as `asr/cli.py` would with
    ``from .data_commands import prepare``; the data tools, the cheapest handlers to import) pulls numpy
    into ``mariana asr --help``."""
    row = help_imports([["asr"]], prelude="import mariana.apps.asr.data_commands\n")["asr"]
    assert row["code"] == 0 and row["usage"]
    assert "numpy" in row["new"] and "mariana.apps.asr.data_commands" in row["new"]


def test_every_lazy_handler_names_a_function():
    """A typo in a ``dispatch.handler("module:function")`` target would only fail when that command runs:
    resolve every one of asr, vision and serve here."""
    targets = {cmd: t for cmd, t in HANDLER_TARGETS.items() if cmd.split()[0] in ("asr", "vision", "serve")}
    assert set(targets) >= {"asr prepare", "asr train", "asr eval", "vision classify", "serve"}, targets
    for command, target in targets.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr, None)), (command, target)
