"""Handlers of ``mariana pctr train|eval|drift-logs|stream`` (their parsers: `cli.py`). Imported only when one
of these commands runs (`mariana.platform.cli.dispatch`), so the training code is imported at the top."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from mariana.platform.cli.common import check_data_path, check_fresh_run_dir
from mariana.platform.cli.console import warn_skipped
from mariana.platform.core.config import read_config_values, resolve_config
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.export import warm_start_note
from mariana.platform.core.rundir import RunDir, eval_result_path
from mariana.platform.ps.master import run_job
from mariana.platform.runtime.launch import in_worker

from .configs import PRESETS, PctrConfig
from .data.drift import generate
from .data.reader import ClickSource
from .data.sources import absolute_list, resolve_sources, result_name
from .evaluate import evaluate_run
from .ps import run_ps_process
from .streams.config import STREAM_PRESETS, StreamConfig
from .streams.servers import run_ps_stream_process
from .streams.streamer import run_stream
from .tool_configs import DriftLogsConfig, PctrEvalConfig
from .train import Setup, train_local

# pCTR's way to learn a new day from yesterday's model (README, "Fresh click models")
INCREMENTAL = "to learn the new data from it: --init-from RUN --init-train-state --split 1,0,0 --epochs 1"


def _headline(m: dict, cfg=None) -> str:
    if cfg is not None:
        return _headline(m) + warm_start_note(cfg, m, INCREMENTAL)
    auc = m.get("val_auc", float("nan"))
    if auc != auc and "steps" in m and not m.get("epochs"):  # NaN: no validation rows (--split 1,0,0)
        return f"trained {m['steps']} steps (no validation rows); exported the final model"
    return f"validation AUC {m.get('val_auc', float('nan')):.4f} logloss {m.get('val_logloss', float('nan')):.4f}"


def workers_progress(run: Path) -> str:
    """``pctr train: worker 0 step 120 loss 0.4512, worker 1 ...`` from each worker's last complete counters
    record (RUN/counters/worker-W.jsonl: the last line may be half written); '' before the first."""
    done = []
    for p in sorted((run / "counters").glob("worker-*.jsonl"), key=lambda p: int(p.stem[7:])):
        rec = json.loads(([""] + p.read_text().split("\n"))[-2] or "{}")
        loss = f" loss {rec['loss']:.4f}" if "loss" in rec else ""  # none in the validation record
        done += [f"worker {p.stem[7:]} step {rec['step']}{loss}"] if rec else []
    return "pctr train: " + ", ".join(done) if done else ""


def _check_run_dir(cfg, command: str = "pctr train") -> None:
    """The platform's --out/--resume checks, plus: a finished run written before one-process checkpoints
    existed (a model but no checkpoint) is not trained over either."""
    check_fresh_run_dir(cfg, command)
    out = Path(cfg.out)
    if not cfg.resume and any((out / n).exists() for n in ("model.safetensors", "metrics.json")):
        raise MarianaError(
            f"{cfg.out} already holds a trained run; pass --resume to continue it or choose another --out"
        )


def train(args, argv) -> int:
    """``mariana pctr train``: one process (``--servers 0``) or S servers + W workers under torchrun."""
    cfg = resolve_config(PctrConfig, args, PRESETS)
    cfg = replace(cfg, data=absolute_list(cfg.data))
    sources = resolve_sources(cfg.data)  # a file, a comma-separated list of files or a folder of partitions
    if cfg.servers > 0 and in_worker():
        return run_ps_process(cfg, sources)
    _check_run_dir(cfg)
    # Input errors are found here, once, not by S + W processes and every torchrun restart after them.
    setup = Setup(cfg, ClickSource.from_sections(cfg.input, cfg.rows, sources))
    setup.check_batch_size()
    if cfg.servers == 0:
        final = train_local(cfg, setup)
        warn_skipped(cfg.data, final.get("skipped_lines"), final.get("skipped_examples"))
        print(_headline(final, cfg))
        return 0
    RunDir(cfg.out).save_config(cfg)
    nprocs = cfg.servers + cfg.workers
    if cfg.nnodes > 1:
        if nprocs % cfg.nnodes:
            raise MarianaError(f"--servers + --workers = {nprocs} is not divisible by --nnodes {cfg.nnodes}")
        nprocs //= cfg.nnodes
    # the workers draw no bar here: a line now and then from the launcher
    rc = run_job(nprocs, argv, cfg.out, cfg.section("ps"), progress=lambda: workers_progress(Path(cfg.out)))
    final = Path(cfg.out) / "metrics.json"
    if rc == 0 and final.is_file():
        m = json.loads(final.read_text())
        warn_skipped(cfg.data, m.get("skipped_lines"), m.get("skipped_examples"))
        print(_headline(m, cfg))
    elif rc == 0:
        print("mariana: error: the job ended without writing metrics.json", file=sys.stderr)
        return 1
    return rc


def evaluate(args, argv) -> int:
    """``mariana pctr eval``: AUC/logloss of a trained run on (a split of) data; writes RUN/eval/*.json."""
    cfg = resolve_config(PctrEvalConfig, args)
    sources = resolve_sources(cfg.data)
    check_data_path(cfg.model, "--model")
    out = eval_result_path(cfg.model, result_name(cfg.data), cfg.split)
    r = evaluate_run(cfg.model, sources, cfg.format, cfg.split, cfg.device, out)
    warn_skipped(cfg.data, r["skipped"], r["skipped_examples"])
    print(
        f"AUC {r['auc']:.4f} logloss {r['logloss']:.4f} on {cfg.data} ({cfg.split} split, {r['rows']} rows)"
    )
    return 0


def drift_logs(args, argv) -> int:
    """``mariana pctr drift-logs``: write days of drifting click logs."""
    cfg = resolve_config(DriftLogsConfig, args)
    generate(cfg.out, cfg.world.settings())
    return 0


def stream(args, argv) -> int:
    """``mariana pctr stream``: follow a folder of click logs (one process, or servers under torchrun)."""
    cfg = resolve_config(StreamConfig, args, STREAM_PRESETS)
    if cfg.servers > 0 and in_worker():  # one process of a parameter-server stream (streams/servers.py)
        return run_ps_stream_process(cfg)
    if not check_data_path(cfg.data).is_dir():
        raise MarianaError(f"--data {cfg.data}: expected a folder to follow (new log files land in it)")
    saved = Path(cfg.out) / "config.toml"
    if cfg.resume and cfg.format == "libfm" and cfg.num_fields == 0 and saved.is_file():
        # the stream inferred it from its first file
        cfg.num_fields = int(read_config_values(saved).get("num_fields", 0))
    check_fresh_run_dir(cfg, "pctr stream")
    if not cfg.resume and any((Path(cfg.out) / n).exists() for n in ("model.safetensors", "metrics.json")):
        raise MarianaError(
            f"{cfg.out} already holds a run; pass --resume to continue it or choose another --out"
        )
    if cfg.servers > 0:
        return _stream_ps(cfg, argv)
    t = run_stream(cfg)
    final = Path(cfg.out) / "metrics.json"  # the totals with the last file's scores
    print(_stream_headline(json.loads(final.read_text()) if final.is_file() else t))
    return 0


def _stream_headline(t: dict) -> str:
    """The stream's last line: totals, then the headline metric (the last file's progressive AUC: the
    model scored on that file before training on it)."""
    auc = t.get("progressive_auc")
    last = f", last file's progressive AUC {auc:.4f}" if isinstance(auc, float) else ""
    return f"stream: {t['files']} files, {t['rows']} rows, {t['exports']} exports, version {t['version'] or 'none'}{last}"


def _stream_ps(cfg, argv) -> int:
    """Launch a parameter-server stream: S servers + W workers under torchrun (`run_job`), worker 0's
    console lines on the terminal; prints the totals from RUN/metrics.json."""
    RunDir(cfg.out).save_config(cfg)
    nprocs = cfg.servers + cfg.workers
    rc = run_job(nprocs, argv, cfg.out, cfg.section("ps"), console_rank=cfg.servers)
    final = Path(cfg.out) / "metrics.json"
    if rc == 0 and final.is_file():
        print(_stream_headline(json.loads(final.read_text())))
    return rc
