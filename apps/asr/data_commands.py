"""Handlers of ``mariana asr prepare`` and ``mariana asr synth`` (the data tools: numpy and soundfile, no
torch), loaded by `mariana.platform.cli.dispatch` only when one of them runs."""

from __future__ import annotations

import argparse
import sys

from mariana.platform.cli.common import check_data_path
from mariana.platform.cli.console import warn_skipped
from mariana.platform.core.errors import MarianaError

from .data import parse_speakers
from .data import prepare as prepare_data
from .synth import synthesize


def prepare(args: argparse.Namespace, argv: list[str]) -> int:
    """``asr prepare``: Kaldi data dirs OUT/{train,dev,test} from --data (`data.prepare`); one line per
    unreadable recording, then the counts."""
    check_data_path(args.data)
    if args.synth_ratio is not None and not args.synth:
        raise MarianaError("--synth-ratio applies to runs with --synth only (no synthetic speakers given)")
    r = prepare_data(
        args.data,
        args.out,
        parse_speakers(args.test_speakers),
        parse_speakers(args.dev_speakers),
        args.utterances,
        args.max_digits,
        args.seed,
        args.synth or None,
        1.0 if args.synth_ratio is None else args.synth_ratio,
    )
    warn_skipped(args.data, len(r.skipped), r.skipped, "unreadable recording")
    for path, reason in r.skipped[1:]:  # the first is named in the warning
        print(f"  {path}: {reason}", file=sys.stderr)
    only = ""
    if not r.counts["train"] and not r.counts["dev"]:
        only = f" (a test-only set: `mariana asr eval --model RUN --data {args.out}/test`)"
    print(
        f"prepared {args.out}: train {r.counts['train']} dev {r.counts['dev']} test {r.counts['test']} "
        f"utterances, skipped {len(r.skipped)}{only}"
    )
    return 0


def synth(args: argparse.Namespace, argv: list[str]) -> int:
    """``asr synth``: synthetic digit speakers into the FSDD-layout folder --out (`synth.synthesize`)."""
    r = synthesize(args.out, args.speakers, args.takes, args.seed, args.sample_rate, jobs=args.jobs)
    for path, reason in r.skipped[:10]:
        print(f"  skipped {path}: {reason}")
    print(
        f"synthesised {args.out}: {r.speakers} speakers, {r.files} files ({r.generated} generated, "
        f"{r.files - r.generated} from the cache, {r.regenerated} unreadable cached files regenerated), "
        f"skipped {len(r.skipped)}"
    )
    return 0
