"""What a command may write into: nothing the user made is replaced without ``--force`` (the rule:
``platform/README.md``, "Nothing is written over data a command did not create").

Every flag naming a folder a command writes into is marked on its argparse action (`mark_output`:
``action.output = (kind, reuse)``), so tests and `guard_output` find them all from the parser. ``reuse``:
``run`` (a train/stream run directory: `common.check_fresh_run_dir` decides), ``continue`` (the command
continues its own earlier output) or ``never`` (a re-run into its own output needs ``--force``). The marker
``FOLDER/.mariana-output`` names the command that made the folder; an unmarked run directory counts as one
only when `legacy_run` proves it. ``IGNORED`` files (the job service's and tune's logs of this very
invocation, the Slurm batch script, written before the command starts) do not count as existing data."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from ..core.config.files import flatten, load_toml
from ..core.errors import MarianaError

MARKER = ".mariana-output"
IGNORED = frozenset({MARKER, "job.log", "trial.log", "slurm-job.sh"})
REUSE = ("run", "continue", "never")
# a folder kind that is no command (``asr feature cache``) -> the command (and flag) a message names instead
MADE_BY: dict[str, str] = {}
# the same for the commands that continue their own output: the file each writes first, so that a folder
# it made but could not mark (killed before the end) is still recognised
LAYOUT = {
    "tune": ("study.json",),
    "asr synth": ("synth.json",),
    "asr eval": ("eval.json", "*-data/loso.json"),
}


def mark_output(parser: argparse.ArgumentParser, flag: str, reuse: str, kind: str = "") -> None:
    """Mark ``flag`` of ``parser`` as a folder the command writes into (``reuse``: see the module), and add
    ``--force`` to ``parser`` unless it has it. ``kind`` defaults to the command (``parser.prog`` without
    ``mariana``)."""
    assert reuse in REUSE, reuse
    action = next(a for a in parser._actions if flag in a.option_strings)
    command = parser.prog.removeprefix("mariana").strip()
    action.output = (kind or command, reuse)
    if kind:
        MADE_BY[kind] = f"`mariana {command}` ({flag})"
    if not any("--force" in a.option_strings for a in parser._actions):
        parser.add_argument(
            "--force",
            action="store_true",
            help="write into an existing output folder that holds data this command did not create "
            "(or its own earlier output, where a re-run would replace it)",
        )
    outputs = dict(parser.get_default("_outputs") or {})
    outputs[action.dest] = (flag, *action.output)
    parser.set_defaults(_outputs=outputs)


def command_of(args: argparse.Namespace, dest: str = "out") -> tuple[str, str]:
    """(command, reuse) that `mark_output` recorded for ``dest`` of the parsed command ("", "run" if none)."""
    spec = (getattr(args, "_outputs", None) or {}).get(dest)
    return (spec[1], spec[2]) if spec else ("", "run")


def named(kind: str) -> str:
    """``kind`` (a marker's command or folder kind) as a message names it: the command that makes it."""
    return MADE_BY.get(kind, f"`mariana {kind}`")


def owner(folder: Path) -> str | None:
    """The command named by ``folder``'s marker, or None (no marker, or an unreadable one)."""
    try:
        return str(json.loads((folder / MARKER).read_text())["command"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def legacy_run(folder: Path, config_cls: type | None) -> bool:
    """``folder`` is an unmarked run of the command whose config class is ``config_cls``: its
    ``config.toml`` parses as that class's sections (a flat one from earlier versions: only its fields) and
    it has ``checkpoints/latest`` or ``metrics.jsonl``."""
    if config_cls is None or not (
        (folder / "checkpoints" / "latest").is_file() or (folder / "metrics.jsonl").is_file()
    ):
        return False
    try:
        values, _ = flatten(load_toml(folder / "config.toml"), config_cls)
    except MarianaError:
        return False
    fields = {f.replace("-", "_") for f in values}
    return bool(fields) and fields <= set(config_cls.__dataclass_fields__)


def guard_output(
    path: str,
    flag: str,
    command: str,
    reuse: str,
    force: bool,
    create: bool = True,
    config_cls: type | None = None,
) -> Path:
    """Check ``path`` (the value of ``flag``) as the module says, create the folder and write its marker
    (``create``; else `mark` does it once the command has run); returns the folder. MarianaError (one
    line) when it holds data ``command`` may not replace. ``config_cls``: the run command's config class
    (`legacy_run`; without it an unmarked folder is never taken for a run)."""
    p = Path(path)
    if p.exists() and not force:
        if not p.is_dir():
            if reuse == "run":
                raise MarianaError(f"{flag} {path}: is an existing file, expected a run directory")
            raise MarianaError(f"{flag} {path}: exists and is not a folder (expected an output folder)")
        held = sorted(e.name for e in p.iterdir() if e.name not in IGNORED)
        made_by = owner(p)
        layout = LAYOUT.get(command, ()) if reuse == "continue" else ()
        legacy = made_by is None and (
            legacy_run(p, config_cls) if reuse == "run" else any(any(p.glob(n)) for n in layout)
        )
        if held and not (made_by == command and reuse != "never") and not legacy:
            what = (
                f"the output of an earlier {named(made_by)}"
                if made_by
                else f"data {named(command)} did not create ({len(held)} entries, e.g. {held[0]})"
            )
            raise MarianaError(
                f"{flag} {path}: already holds {what}; pass --force to write into it anyway, or choose "
                f"another {flag}"
            )
    if not create:
        return p
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if reuse == "run":
            raise MarianaError(
                f"{flag} {path}: cannot create the run directory ({e.strerror or e})"
            ) from None
        raise MarianaError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    try:
        mark(p, command)
    except OSError as e:
        raise MarianaError(f"{flag} {path}: cannot be written ({e.strerror or e})") from None
    return p


def foreign(folder: Path) -> bool:
    """``folder`` is a file, or a folder holding data without a marker: the job service keeps its own
    files (``job.log``, ``job.exit``) out of it, whatever the command then decides."""
    held = folder.is_dir() and owner(folder) is None and any(e.name not in IGNORED for e in folder.iterdir())
    return held or (folder.exists() and not folder.is_dir())


def mark(folder: Path, command: str) -> None:
    """Write ``folder``'s marker naming ``command`` (unless it names it already)."""
    if owner(folder) != command:
        stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        (folder / MARKER).write_text(json.dumps({"command": command, "created": stamp}) + "\n")


def guard_parsed(args: argparse.Namespace) -> list[tuple[Path, str]]:
    """`guard_output` (without creating anything: a command that refuses its input leaves no folder) for
    every marked flag of the parsed command that was given a value, except run directories (reuse
    ``run``: a train command's ``--out`` may come from a TOML file, so `common.check_fresh_run_dir`
    checks the resolved value). Returns ``[(folder, command)]`` for `mark_made` after the command ran."""
    checked = []
    for dest, (flag, command, reuse) in (getattr(args, "_outputs", None) or {}).items():
        value = getattr(args, dest, None)
        if value and reuse != "run":
            force = bool(getattr(args, "force", False))
            checked.append((guard_output(value, flag, command, reuse, force, create=False), command))
    return checked


def mark_made(checked: list[tuple[Path, str]]) -> None:
    """After the command ran: mark each checked output folder it made or wrote into (see `guard_parsed`)."""
    for folder, command in checked:
        if folder.is_dir():
            try:
                mark(folder, command)
            except OSError:
                pass  # a folder the command could write but not this: nothing to recognise it by later
