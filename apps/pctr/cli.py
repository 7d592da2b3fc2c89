"""``mariana pctr train|eval|drift-logs|stream``: click-through-rate prediction (single process or parameter servers).

Only the standard library is imported at module level (``mariana --help`` stays fast)."""

from __future__ import annotations

import argparse
import sys

from mariana.platform.cli.console import warn_skipped

# pCTR's way to learn a new day from yesterday's model (README, "Fresh click models")
INCREMENTAL = "to learn the new data from it: --init-from RUN --init-train-state --split 1,0,0 --epochs 1"


def _headline(m: dict, cfg=None) -> str:
    if cfg is not None:
        from mariana.platform.core.warmstart import warm_start_note

        return _headline(m) + warm_start_note(cfg, m, INCREMENTAL)
    auc = m.get("val_auc", float("nan"))
    if auc != auc and "steps" in m and not m.get("epochs"):  # NaN: no validation rows (--split 1,0,0)
        return f"trained {m['steps']} steps (no validation rows); exported the final model"
    return f"validation AUC {m.get('val_auc', float('nan')):.4f} logloss {m.get('val_logloss', float('nan')):.4f}"


def _check_run_dir(cfg, command: str = "pctr train") -> None:
    """The platform's --out/--resume checks, plus: a finished run written before one-process checkpoints
    existed (a model but no checkpoint) is not trained over either."""
    from pathlib import Path

    from mariana.platform.cli.common import check_fresh_run_dir
    from mariana.platform.core.errors import MarianaError

    check_fresh_run_dir(cfg, command)
    out = Path(cfg.out)
    if not cfg.resume and any((out / n).exists() for n in ("model.safetensors", "metrics.json")):
        raise MarianaError(
            f"{cfg.out} already holds a trained run; pass --resume to continue it or choose another --out"
        )


def _train(args, argv) -> int:
    import json
    from dataclasses import replace
    from pathlib import Path

    from mariana.platform.core.config import resolve_config
    from mariana.platform.runtime.launch import in_worker

    from .configs import PRESETS, PctrConfig
    from .sources import absolute_list, resolve_sources

    cfg = resolve_config(PctrConfig, args, PRESETS)
    cfg = replace(cfg, data=absolute_list(cfg.data))
    resolve_sources(cfg.data)  # a file, a comma-separated list of files or a folder of partitions
    if cfg.servers > 0 and in_worker():
        from .ps import run_ps_process

        return run_ps_process(cfg)
    _check_run_dir(cfg)
    from .train import Setup

    # Input errors are found here, once, not by S + W processes and every torchrun restart after them.
    setup = Setup(cfg)
    setup.check_batch_size()
    if cfg.servers == 0:
        from .train import train_local

        final = train_local(cfg, setup)
        warn_skipped(cfg.data, final.get("skipped_lines"), final.get("skipped_examples"))
        print(_headline(final, cfg))
        return 0
    from mariana.platform.core.rundir import RunDir
    from mariana.platform.ps.master import run_job

    RunDir(cfg.out).save_config(cfg)
    nprocs = cfg.servers + cfg.workers
    if cfg.nnodes > 1:
        if nprocs % cfg.nnodes:
            from mariana.platform.core.errors import MarianaError

            raise MarianaError(f"--servers + --workers = {nprocs} is not divisible by --nnodes {cfg.nnodes}")
        nprocs //= cfg.nnodes
    rdzv = (cfg.nnodes, cfg.rdzv_endpoint, cfg.rdzv_id)
    rc = run_job(nprocs, argv, cfg.out, cfg.max_restarts, *rdzv, num_servers=cfg.servers)
    final = Path(cfg.out) / "metrics.json"
    if rc == 0 and final.is_file():
        m = json.loads(final.read_text())
        warn_skipped(cfg.data, m.get("skipped_lines"), m.get("skipped_examples"))
        print(_headline(m, cfg))
    elif rc == 0:
        print("mariana: error: the job ended without writing metrics.json", file=sys.stderr)
        return 1
    return rc


def _eval(args, argv) -> int:
    from mariana.platform.cli.common import check_data_path
    from mariana.platform.core.rundir import eval_result_path

    from .evaluate import evaluate_run
    from .sources import resolve_sources, result_name

    resolve_sources(args.data)
    check_data_path(args.model, "--model")
    out = eval_result_path(args.model, result_name(args.data), args.split)
    r = evaluate_run(args.model, args.data, args.format, args.split, args.device, out)
    warn_skipped(args.data, r["skipped"], r["skipped_examples"])
    print(
        f"AUC {r['auc']:.4f} logloss {r['logloss']:.4f} on {args.data} ({args.split} split, {r['rows']} rows)"
    )
    return 0


def register(sub) -> None:
    from mariana.platform.cli.common import add_train_parser
    from mariana.platform.cli.outputs import mark_output

    from .configs import PRESETS, PctrConfig

    grp = sub.add_parser(
        "pctr", help="click-through-rate prediction (LR/FM/DNN/DeepFM/DCN, parameter servers)"
    )
    g = grp.add_subparsers(dest="pctr_command", required=True, metavar="COMMAND")
    t = add_train_parser(
        g,
        "train",
        PctrConfig,
        "train a click model in one process (--servers 0) or with S parameter servers and W async workers",
        _train,
        PRESETS,
    )
    mark_output(t, "--image-cache", "continue", "pctr image cache")
    e = g.add_parser(
        "eval",
        help="AUC/logloss of a trained run on a data file; writes RUN/eval/<data>[-<split>].json",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    e.add_argument("--model", required=True, help="run directory of a finished `mariana pctr train`")
    e.add_argument(
        "--data",
        required=True,
        help="Criteo TSV or libFM data to score: a file, a comma-separated list of files or a folder of "
        "partitions (its files in name order, without names starting with '.' or '_')",
    )
    e.add_argument(
        "--format", choices=["criteo", "libfm"], default=None, help="data format (default: the model's)"
    )
    e.add_argument(
        "--split",
        choices=["all", "train", "val", "test"],
        default="all",
        help="score only this row-order split of the file, cut with the fractions the run was trained with "
        "(its config.toml's split); a split the run does not have is refused",
    )
    e.add_argument("--device", default="cpu", help="cpu or cuda")
    e.set_defaults(func=_eval)
    _register_drift(g)
    _register_stream(g)


def _drift_logs(args, argv) -> int:
    from .drift import DriftSettings, generate

    names = [f for f in DriftSettings.__dataclass_fields__ if f != "out"]
    generate(args.out, DriftSettings(**{k: getattr(args, k) for k in names}))
    return 0


def _register_drift(g) -> None:
    """``mariana pctr drift-logs``: the drifting click-log generator (`drift.py`)."""
    from dataclasses import fields

    from .drift import DriftSettings

    helps = {
        "days": "days to write (DIR/day-01.tsv ...)",
        "rows_per_day": "impressions per day file",
        "seed": "random seed (same settings and seed -> the same bytes)",
        "ads": "ads alive on any day",
        "new_ads": "share of the alive ads replaced by newborn ads (new ids) each new day",
        "new_users": "share of each day's impressions from user ids never seen before",
        "users": "returning users available on day 1",
        "segments": "user segments (the segment x ad category affinity drives clicks)",
        "categories": "ad categories",
        "sites": "sites (publishers)",
        "drift": "day-to-day drift of the affinities and ad effects: x <- sqrt(1-a^2) x + a * fresh "
        "(0: fixed, 1: redrawn every day)",
        "affinity": "std (logits) of the segment x category affinity",
        "rank": "latent taste dimensions behind the segment x category affinity",
        "ad_effect": "std (logits) of each ad's own effect",
        "ctr": "click rate of an average impression",
    }
    d = g.add_parser(
        "drift-logs",
        help="write days of drifting Criteo-format click logs (ads born and retired, drifting click rates)",
        description="Writes DIR/day-01.tsv ... (label, I1-I13, C1-C26; each file written under a temporary "
        "name and renamed) and DIR/_generator.json; deterministic from the settings. Columns and the model "
        "behind them: apps/pctr/README.md, 'Day partitions, incremental training and drifting click logs'.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d.add_argument("--out", required=True, help="folder to write the day files into (created)")
    for f in fields(DriftSettings):
        d.add_argument(
            f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, help=helps[f.name]
        )
    d.set_defaults(func=_drift_logs)
    from mariana.platform.cli.outputs import mark_output

    mark_output(d, "--out", "never")


def _stream(args, argv) -> int:
    import json
    from pathlib import Path

    from mariana.platform.cli.common import check_data_path, check_fresh_run_dir
    from mariana.platform.core.config import resolve_config
    from mariana.platform.core.errors import MarianaError

    from .stream import STREAM_PRESETS, StreamConfig, run_stream

    cfg = resolve_config(StreamConfig, args, STREAM_PRESETS)
    if cfg.servers > 0:
        from mariana.platform.runtime.launch import in_worker

        if in_worker():  # one process of a parameter-server stream (stream_ps.py)
            from .stream_ps import run_ps_stream_process

            return run_ps_stream_process(cfg)
    if not check_data_path(cfg.data).is_dir():
        raise MarianaError(f"--data {cfg.data}: expected a folder to follow (new log files land in it)")
    saved = Path(cfg.out) / "config.toml"
    if cfg.resume and cfg.format == "libfm" and cfg.num_fields == 0 and saved.is_file():
        from mariana.platform.core.config import load_toml

        cfg.num_fields = int(
            load_toml(saved).get("num_fields", 0)
        )  # the stream inferred it from its first file
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
    import json
    from pathlib import Path

    from mariana.platform.core.rundir import RunDir
    from mariana.platform.ps.master import run_job

    RunDir(cfg.out).save_config(cfg)
    nprocs = cfg.servers + cfg.workers
    rc = run_job(nprocs, argv, cfg.out, cfg.max_restarts, console_rank=cfg.servers, num_servers=cfg.servers)
    final = Path(cfg.out) / "metrics.json"
    if rc == 0 and final.is_file():
        print(_stream_headline(json.loads(final.read_text())))
    return rc


def _register_stream(g) -> None:
    """``mariana pctr stream``: follow a folder of new log files (`stream.py`)."""
    from mariana.platform.cli.common import add_train_parser
    from mariana.platform.cli.outputs import mark_output

    from .stream import STREAM_PRESETS, StreamConfig

    s = add_train_parser(
        g,
        "stream",
        StreamConfig,
        "follow a folder of click logs: score each new complete file with the current model (progressive "
        "AUC), train on it once in arrival order, export a new model version every N files or S seconds "
        "(`mariana serve --pctr RUN --watch` picks it up); checkpoint with the consumed-file ledger after "
        "each file (--resume continues); stops on Ctrl-C, --max-files or --idle-exit",
        _stream,
        STREAM_PRESETS,
    )
    mark_output(s, "--image-cache", "continue", "pctr image cache")
