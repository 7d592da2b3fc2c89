"""Handlers of ``mariana asr train|eval|transcribe`` (parsers: `cli.py`; torch and the model code imported at
the top), loaded by `mariana.platform.cli.dispatch` only when one of them runs."""

from __future__ import annotations

import argparse
import sys

from mariana.platform.cli.common import check_data_path, run_training
from mariana.platform.core.errors import MarianaError

from .configs import PRESETS, AsrConfig, check_decode
from .evaluate import evaluate_run
from .loso import run_loso
from .predict import Transcriber
from .train import train as train_run

# eval's flags that only --loso reads (each fold's prepare and train)
_LOSO_ONLY = ("out", "speakers", "utterances", "max_digits", "seed", "synth", "synth_ratio", "train_args")


def headline(m: dict) -> str:
    """The last line of ``asr train``: dev WER/SER when the run evaluated, else the training loss."""
    if "eval_wer" in m:
        return f"dev WER {m['eval_wer']:.2f}% SER {m.get('eval_ser', float('nan')):.2f}%"
    return f"train loss {m.get('train_loss', float('nan')):.4f}"


def train(args: argparse.Namespace, argv: list[str]) -> int:
    """``asr train`` (`run_training`)."""
    return run_training(args, argv, AsrConfig, PRESETS, train_run, headline)


def check_decode_flags(args: argparse.Namespace) -> None:
    """--beam, --lm-weight and --jobs of eval/transcribe checked before any data is read."""
    check_decode(args.beam, args.lm_weight)
    if getattr(args, "jobs", 1) < 1:
        raise MarianaError(f"--jobs must be >= 1, got {args.jobs}")


def eval_loso(args: argparse.Namespace) -> int:
    """``eval --loso``: every speaker of an FSDD folder held out in turn (`loso.run_loso`)."""
    if args.model:
        raise MarianaError(
            "--model is not used with --loso (each fold trains its own model in OUT/<speaker>)"
        )
    if not args.out:
        raise MarianaError("--loso needs --out (the folder for every fold's data, run and eval.json)")
    check_decode_flags(args)
    if args.lm_weight is not None or args.word_bonus is not None:
        raise MarianaError(
            "--lm-weight/--word-bonus are not used with --loso (pass them in --train-args: each fold's "
            "run then decodes with them)"
        )
    # the fold flags given (None: run_loso's own default, stated there once)
    loso = {k: getattr(args, k) for k in _LOSO_ONLY if getattr(args, k) is not None}
    scoring = {k: getattr(args, k) for k in ("beam", "jobs", "tempo", "cmvn", "vtln", "fresh")}
    r = run_loso(args.data, **scoring, **loso)
    w = r["worst"]
    print(
        f"LOSO mean WER {r['mean_wer']:.2f}% worst {w['wer']:.2f}% ({w['speaker']}) over "
        f"{len(r['folds'])} speakers -> {r['path']}"
    )
    return 0


def evaluate(args: argparse.Namespace, argv: list[str]) -> int:
    """``asr eval``: WER/SER of the run --model on the Kaldi dir --data (`evaluate.evaluate_run`, which
    writes RUN/eval/<data name>.json), or the --loso table."""
    check_data_path(args.data)
    if args.loso:
        return eval_loso(args)
    if not args.model:
        raise MarianaError("--model is required (a run directory of `mariana asr train`), or pass --loso")
    given = [k for k in _LOSO_ONLY if getattr(args, k) is not None] + (["fresh"] if args.fresh else [])
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise MarianaError(f"{flags}: only used with --loso")
    check_data_path(args.model, "--model")
    check_decode_flags(args)
    r = evaluate_run(
        args.model,
        args.data,
        args.beam,
        args.jobs,
        args.tempo,
        args.cmvn,
        args.lm_weight,
        args.word_bonus,
        vtln=args.vtln,
    )
    if r["note"]:
        print(f"note: {r['note']}")
    if r["skipped"]:
        print(f"skipped {r['skipped']} unreadable recording(s): {', '.join(r['skipped_paths'][:5])}")
    tempos = " ".join(f"{k}={v:g}" for k, v in sorted(r["speaker_tempo"].items()))
    warps = " ".join(f"{k}={v:g}" for k, v in sorted(r["speaker_vtln"].items()))
    print(
        f"utterances {r['utterances']} words {r['words']} beam {r['beam']} lm-weight {r['lm_weight']:g} "
        f"word-bonus {r['word_bonus']:g} tempo {r['tempo']} ({tempos}) "
        f"vtln {r['vtln']} ({warps}) cmvn {r['cmvn']} -> {r['path']}"
    )
    print(f"WER {r['wer']:.2f}% SER {r['ser']:.2f}%")
    return 0


def transcribe(args: argparse.Namespace, argv: list[str]) -> int:
    """``asr transcribe``: ``PATH<TAB>words`` per WAV file; a bad file is reported on stderr and skipped,
    and any failure makes the exit status 2."""
    check_data_path(args.model, "--model")
    check_decode_flags(args)
    t = Transcriber(args.model, beam=args.beam, lm_weight=args.lm_weight, word_bonus=args.word_bonus)
    if t.decoding.note:
        print(f"note: {t.decoding.note}", file=sys.stderr, flush=True)
    failed = 0
    for path in args.wavs:  # a bad file is reported and skipped; the others are still transcribed
        try:
            print(f"{path}\t{t.transcribe_file(path)}", flush=True)
        except MarianaError as e:
            print(f"mariana: error: {e} (skipped)", file=sys.stderr, flush=True)
            failed += 1
        except Exception as e:  # a decoder failing on strange input must not lose the other files
            print(f"mariana: error: {path}: {type(e).__name__}: {e} (skipped)", file=sys.stderr, flush=True)
            failed += 1
    done = f"transcribed {len(args.wavs) - failed} of {len(args.wavs)} file(s)"
    if failed:
        raise MarianaError(f"{done}: {failed} failed")
    print(done)
    return 0
