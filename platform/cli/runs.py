"""``mariana runs show RUN``, ``mariana runs ls DIR`` and ``mariana export RUN --format onnx``: what a run
folder holds, without opening its JSON, and its model for another runtime.

A folder is a run by `outputs`' rule: its ``.mariana-output`` marker names a command whose ``--out`` is a run
directory (train, stream), or it is a run an earlier version wrote that its own files prove
(`outputs.legacy_run`). Reads only the run's files (standard library: no torch); ``export`` is handled by
`mariana.platform.core.onnx_export`, imported when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from pathlib import Path

from ..core.errors import MarianaError
from ..core.jsonfile import read_json
from .common import DefaultsHelpFormatter, checkpoint_step, subcommands
from .dispatch import handler
from .main import build_parser
from .outputs import legacy_run, owner

SKIP = frozenset({"checkpoints", "logs", "eval"})  # folders of a run, never runs themselves


def register(sub) -> None:
    e = sub.add_parser("export", help="write a run's model for another runtime (onnx), checked against torch",
                       description="Write RUN/model.onnx (+ model.onnx.json) from RUN/model.safetensors: pCTR's "
                       "table lookups and dense part, vision's network, ASR's acoustic model; ONNX Runtime's "
                       "outputs must equal torch's on held-out inputs.", formatter_class=DefaultsHelpFormatter)  # fmt: skip
    e.add_argument("run", metavar="RUN", help="a run directory with an exported model")
    e.add_argument("--format", required=True, choices=["onnx"], help="the format to write")
    e.add_argument(
        "--atol", type=float, default=1e-5, help="largest |onnxruntime - torch| allowed, plus --rtol"
    )
    e.add_argument("--rtol", type=float, default=1e-5, help="relative part of the tolerance")
    e.set_defaults(func=handler("mariana.platform.core.onnx_export:command"))
    g = sub.add_parser("runs", help="inspect run directories: show RUN, ls DIR")
    gs = g.add_subparsers(dest="runs_command", required=True, metavar="COMMAND")
    for name, what, func in (("show", "RUN", show), ("ls", "DIR", ls)):
        p = gs.add_parser(name, formatter_class=DefaultsHelpFormatter, help="a run: app, command, config, "
                          "metrics, checkpoints, model, resume" if name == "show" else "the runs under DIR, one line each")  # fmt: skip
        p.add_argument("path", metavar=what, help="a run directory" if name == "show" else "a folder")
        p.add_argument("--json", action="store_true", help="print JSON instead of text")
        p.set_defaults(func=func)


def run_commands() -> dict[str, type | None]:
    """{command: its config class} of every command whose ``--out`` is a run directory (``pctr train``, ...)."""
    found: dict[str, type | None] = {}

    def walk(p: argparse.ArgumentParser) -> None:
        cfg = p.get_default("_config")
        for _flag, command, reuse in (p.get_default("_outputs") or {}).values():
            if reuse == "run":
                found[command] = cfg[0] if cfg else None
        for child in set(subcommands(p).values()):
            walk(child)

    walk(build_parser())
    return found


def run_command(folder: Path, commands: dict[str, type | None]) -> str | None:
    """The run command that made ``folder``, or None when it is not a run."""
    made_by = owner(folder)
    if made_by is not None:
        return made_by if made_by in commands else None
    return next((c for c, cls in commands.items() if legacy_run(folder, cls)), None)


def _json(path: Path) -> dict | None:
    return value if isinstance(value := read_json(path), dict) else None


def _last_records(path: Path, tail: int = 1 << 16) -> dict:
    """The last training record and the last evaluation record of ``metrics.jsonl``, merged (its last
    ``tail`` bytes are read: the file grows with every logged step)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return {}
    last: dict = {}
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        kind = "eval" if any(k.startswith("eval_") for k in rec) else "train"
        last.setdefault(kind, {k: v for k, v in rec.items() if k != "time"})
    return {**last.get("train", {}), **last.get("eval", {})}


def describe(folder: Path, command: str) -> dict:
    """What ``runs show`` says about the run ``folder`` made by ``command`` (its ``--json``)."""
    try:
        config = tomllib.loads((folder / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        config = {}
    final, model, onnx = (_json(folder / n) for n in ("metrics.json", "model.json", "model.onnx.json"))
    ckpt = folder / "checkpoints"
    latest = checkpoint_step(ckpt / "latest") if (ckpt / "latest").is_file() else None
    max_steps = int(config.get("loop", {}).get("max_steps") or 0)
    resume = {"can": latest is not None and not 0 < max_steps <= latest, "from_step": latest}
    if latest is None:
        resume = {"can": False, "why": "no checkpoint: start it again without --resume"}
    elif not resume["can"]:
        resume["why"] = f"did its --max-steps {max_steps}; pass a larger one"
    else:
        resume["to_step"] = max_steps or "the end of its epochs"
    if onnx and model:  # exported from the weights the run holds now (else serving it refuses it)
        onnx["current"] = onnx.get("source_version") == model.get("version")
    return {
        "run": str(folder), "command": command, "app": (model or {}).get("app", command.split()[0]),
        "config": config, "best": {k: v for k, v in (final or {}).items() if k.startswith("best_") or k == "monitor"},
        "last": _last_records(folder / "metrics.jsonl"), "latest_checkpoint": latest,
        "checkpoints": sorted(int(p.name[5:]) for p in ckpt.glob("step_*") if p.name[5:].isdigit()),
        "model": model and {k: model.get(k) for k in ("arch", "version", "created")},
        "onnx": onnx and {k: onnx.get(k) for k in ("digest", "opset", "source_version", "current")}, "resume": resume,
    }  # fmt: skip


def _pairs(m: dict) -> str:
    return (
        " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in (m or {}).items()) or "-"
    )


def show(args: argparse.Namespace, argv: list[str]) -> int:
    """``mariana runs show RUN [--json]``: one line per item (config: one per section), the resume line last."""
    folder = Path(args.path)
    if not folder.is_dir():
        raise MarianaError(f"{folder}: no such run directory")
    command = run_command(folder, run_commands())
    if command is None:
        raise MarianaError(
            f"{folder}: not a run directory (no run's .mariana-output marker, not a proven older run)"
        )
    d = describe(folder, command)
    if args.json:
        print(json.dumps(d, indent=2, default=str))
        return 0
    r = d["resume"]
    lines = [("run", f"{folder} (mariana {command}; app {d['app']})")]
    lines += [("config", f"[{k}] {_pairs(v) if isinstance(v, dict) else v}") for k, v in d["config"].items()]
    lines += [(k, _pairs(d[k])) for k in ("best", "last", "model", "onnx")]
    lines += [
        ("checkpoints", f"{', '.join(map(str, d['checkpoints'])) or '-'} (latest {d['latest_checkpoint']})")
    ]
    lines += [("resume", f"--resume continues from step {r['from_step']} to {r['to_step']}" if r["can"]
               else f"--resume cannot continue it ({r['why']})")]  # fmt: skip
    print("\n".join(f"{k:<12} {v}" for k, v in lines))
    return 0


def find_runs(top: Path) -> list[tuple[Path, str]]:
    """(folder, command) of every run at or under ``top``, in path order; a run's own folders are not searched."""
    commands, found = run_commands(), []
    for root, dirs, _files in os.walk(top):
        command = run_command(Path(root), commands)
        if command is not None:
            found.append((Path(root), command))
            dirs.clear()
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP)
    return found


def ls(args: argparse.Namespace, argv: list[str]) -> int:
    top = Path(args.path)
    if not top.is_dir():
        raise MarianaError(f"{top}: no such folder")
    runs = [describe(folder, command) for folder, command in find_runs(top)]
    if args.json:
        print(json.dumps(runs, indent=2, default=str))
        return 0
    for d in runs:
        best = " ".join(f"{k}={v:.4g}" for k, v in d["best"].items() if isinstance(v, float)) or "-"
        resume = d["resume"]["from_step"] if d["resume"]["can"] else "no"
        print(f"{d['run']}  {d['command']}  step {d['last'].get('step', '-')}  best {best}  model "
              f"{(d['model'] or {}).get('version', '-')}{'  onnx' * bool(d['onnx'])}  resume {resume}")  # fmt: skip
    print(f"{len(runs)} run{'s' * (len(runs) != 1)} under {top}")
    return 0
