"""``mariana pctr train|eval``: click-through-rate prediction (single process or parameter servers).

Only the standard library is imported at module level (``mariana --help`` stays fast)."""

from __future__ import annotations

import argparse
import sys


def _headline(m: dict) -> str:
    return f"validation AUC {m.get('val_auc', float('nan')):.4f} logloss {m.get('val_logloss', float('nan')):.4f}"


def _warn_skipped(data: str, final: dict) -> None:
    """One console line when malformed lines were skipped (they are listed in metrics.json too)."""
    n = int(final.get("skipped_lines") or 0)
    if not n:
        return
    first = sorted((final.get("skipped_examples") or {}).items(), key=lambda kv: int(kv[0]))
    where = f" (first: line {first[0][0]}: {first[0][1]})" if first else ""
    print(f"mariana: warning: skipped {n} malformed line{'s' * (n != 1)} in {data}{where}", file=sys.stderr)


def _check_run_dir(cfg) -> None:
    """The platform's --out/--resume checks, plus: a finished run written before one-process checkpoints
    existed (a model but no checkpoint) is not trained over either."""
    from pathlib import Path

    from mariana.platform.cli.common import check_fresh_run_dir
    from mariana.platform.core.errors import MarianaError

    check_fresh_run_dir(cfg)
    out = Path(cfg.out)
    if not cfg.resume and any((out / n).exists() for n in ("model.safetensors", "metrics.json")):
        raise MarianaError(
            f"{cfg.out} already holds a trained run; pass --resume to continue it or choose another --out"
        )


def _train(args, argv) -> int:
    import json
    from pathlib import Path

    from mariana.platform.cli.common import check_data_path
    from mariana.platform.core.config import resolve_config
    from mariana.platform.dp.launch import in_worker

    from .configs import PRESETS, PctrConfig

    cfg = resolve_config(PctrConfig, args, PRESETS)
    check_data_path(cfg.data)
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
        _warn_skipped(cfg.data, final)
        print(_headline(final))
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
        _warn_skipped(cfg.data, m)
        print(_headline(m))
    elif rc == 0:
        print("mariana: error: the job ended without writing metrics.json", file=sys.stderr)
        return 1
    return rc


def _eval(args, argv) -> int:
    from mariana.platform.cli.common import check_data_path
    from mariana.platform.core.rundir import eval_result_path

    from .evaluate import evaluate_run

    check_data_path(args.data)
    check_data_path(args.model, "--model")
    out = eval_result_path(args.model, args.data, args.split)
    r = evaluate_run(args.model, args.data, args.format, args.split, args.split_fractions, args.device, out)
    _warn_skipped(args.data, {"skipped_lines": r["skipped"], "skipped_examples": r["skipped_examples"]})
    print(
        f"AUC {r['auc']:.4f} logloss {r['logloss']:.4f} on {args.data} ({args.split} split, {r['rows']} rows)"
    )
    return 0


def register(sub) -> None:
    from mariana.platform.cli.common import add_train_parser

    from .configs import PRESETS, PctrConfig

    grp = sub.add_parser(
        "pctr", help="click-through-rate prediction (LR/FM/DNN/DeepFM/DCN, parameter servers)"
    )
    g = grp.add_subparsers(dest="pctr_command", required=True, metavar="COMMAND")
    add_train_parser(
        g,
        "train",
        PctrConfig,
        "train a click model in one process (--servers 0) or with S parameter servers and W async workers",
        _train,
        PRESETS,
    )
    e = g.add_parser(
        "eval",
        help="AUC/logloss of a trained run on a data file; writes RUN/eval/<data>[-<split>].json",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    e.add_argument("--model", required=True, help="run directory of a finished `mariana pctr train`")
    e.add_argument("--data", required=True, help="Criteo TSV or libFM file to score")
    e.add_argument(
        "--format", choices=["criteo", "libfm"], default=None, help="data format (default: the model's)"
    )
    e.add_argument(
        "--split",
        choices=["all", "train", "val", "test"],
        default="all",
        help="score only this row-order split of the file",
    )
    e.add_argument("--split-fractions", default="0.8,0.1,0.1", help="train,val,test fractions for --split")
    e.add_argument("--device", default="cpu", help="cpu or cuda")
    e.set_defaults(func=_eval)
