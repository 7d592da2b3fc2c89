"""``mariana asr prepare|synth|train|eval|transcribe``: the parsers only (standard library, the CLI helpers
and `configs`, so ``mariana asr --help`` imports neither torch nor numpy). Each leaf names its handler
with `dispatch.handler`: `mariana.apps.asr.data_commands` (prepare, synth) or `mariana.apps.asr.commands`
(train, eval, transcribe), imported only when that command runs."""

from __future__ import annotations

import argparse

from mariana.platform.cli.common import DefaultsHelpFormatter, add_train_parser
from mariana.platform.cli.dispatch import handler
from mariana.platform.cli.outputs import mark_output

from .configs import PRESETS, AsrConfig

_FMT = DefaultsHelpFormatter


def register(sub) -> None:
    """The ``asr`` group and its leaf commands under the ``mariana`` subparsers ``sub``."""
    grp = sub.add_parser(
        "asr", help="speech recognition: connected-digit acoustic DNN with CTC (data parallel)"
    )
    g = grp.add_subparsers(dest="asr_command", required=True, metavar="COMMAND")
    _add_prepare(g)
    _add_synth(g)
    t = add_train_parser(
        g,
        "train",
        AsrConfig,
        "train the acoustic DNN with CTC (--workers N data parallel)",
        handler("mariana.apps.asr.commands:train"),
        PRESETS,
    )
    mark_output(t, "--cache", "continue", "asr feature cache")
    _add_eval(g)
    _add_transcribe(g)


def _add_prepare(g) -> None:
    p = g.add_parser(
        "prepare",
        help="build Kaldi data dirs OUT/{train,dev,test} of connected-digit utterances",
        formatter_class=_FMT,
    )
    p.add_argument("--data", required=True, help="FSDD recordings folder or a Kaldi data dir")
    p.add_argument("--out", required=True, help="output folder for train/, dev/, test/")
    p.add_argument(
        "--test-speakers", default="", help="comma-separated test speakers (default: last speaker)"
    )
    p.add_argument(
        "--dev-speakers",
        default="",
        help="comma-separated dev speakers (default: none, so `asr train` has no dev set to validate on)",
    )
    p.add_argument("--utterances", type=int, default=200, help="connected-digit utterances per speaker")
    p.add_argument("--max-digits", type=int, default=7, help="most digits per utterance")
    p.add_argument("--seed", type=int, default=0, help="random seed (digit order, pauses, noise)")
    p.add_argument(
        "--synth", default="", help="folder of synthetic speakers (`mariana asr synth`) added to training"
    )
    p.add_argument(
        "--synth-ratio",
        type=float,
        default=None,
        help="synthetic training utterances per real training utterance (shared by the synthetic speakers; "
        "default: 1.0); applies with --synth only",
    )
    p.set_defaults(func=handler("mariana.apps.asr.data_commands:prepare"))
    mark_output(p, "--out", "never")


def _add_synth(g) -> None:
    y = g.add_parser(
        "synth",
        help="synthesise digit speakers with a text-to-speech engine (eSpeak NG) into an FSDD-layout folder",
        formatter_class=_FMT,
    )
    y.add_argument("--out", required=True, help="output folder (also the cache: readable files are kept)")
    y.add_argument(
        "--speakers", type=int, default=200, help="synthetic voices (accent x variant x pitch x rate)"
    )
    y.add_argument(
        "--takes", type=int, default=5, help="takes of each digit per voice (jittered rate and pitch)"
    )
    y.add_argument("--seed", type=int, default=0, help="random seed of the voices and the jitter")
    y.add_argument("--sample-rate", type=int, default=8000, help="output sample rate in Hz")
    y.add_argument("--jobs", type=int, default=2, help="speakers synthesised in parallel processes")
    y.set_defaults(func=handler("mariana.apps.asr.data_commands:synth"))
    mark_output(y, "--out", "continue")


def _add_decode_flags(p: argparse.ArgumentParser) -> None:
    """--beam, --lm-weight and --word-bonus of eval and transcribe (None: the run's own setting)."""
    p.add_argument(
        "--beam", type=int, default=None, help="prefix beam width >= 0 (default: the run's --beam; 0 greedy)"
    )
    p.add_argument(
        "--lm-weight",
        type=float,
        default=None,
        help="weight >= 0 of the run's word bigram (training transcripts) in the beam search (default: the "
        "run's --lm-weight; 0 = acoustics only; needs --beam >= 1)",
    )
    p.add_argument(
        "--word-bonus",
        type=float,
        default=None,
        help="log-score added per word in the beam search (default: the run's --word-bonus)",
    )


def _add_eval(g) -> None:
    e = g.add_parser(
        "eval",
        help="WER/SER of a trained run on a Kaldi data dir; writes RUN/eval/<data name>.json "
        "(--loso: every speaker held out in turn, prepared, trained and scored; writes OUT/eval.json)",
        formatter_class=_FMT,
    )
    e.add_argument(
        "--model", default="", help="run directory of `mariana asr train` (required unless --loso)"
    )
    e.add_argument(
        "--data",
        required=True,
        help="Kaldi data dir to score, e.g. OUT/test; with --loso the FSDD recordings folder",
    )
    _add_decode_flags(e)
    e.add_argument("--jobs", type=int, default=2, help="parallel feature threads (>= 1)")
    e.add_argument(
        "--tempo",
        default="1.0",
        help="speaking-rate normalisation: frames every 10 x TEMPO ms, so a speaker TEMPO times slower "
        "than the training speakers is heard at their pace (pitch unchanged); 'auto' picks each "
        "speaker's factor in 0.8..1.2 where the model is most confident (no transcripts used)",
    )
    e.add_argument(
        "--vtln",
        default="1.0",
        help="vocal-tract-length normalisation: the mel filters' frequency axis warped by VTLN (0.7..1.3, "
        "Kaldi VTLN; 1 = none) for every speaker; 'auto' picks each speaker's warp in 0.85..1.15 where the "
        "model is most confident (no transcripts used; with --tempo auto after the tempo); needs --cmvn "
        "speaker",
    )
    e.add_argument(
        "--cmvn",
        default="speaker",
        choices=["speaker", "file"],
        help="feature normalisation: 'speaker' = each speaker's statistics over --data (as in training); "
        "'file' = each file alone with the training speakers' prior, exactly as `transcribe` and the "
        "server do (their transcripts are this mode's hypotheses)",
    )
    _add_loso_flags(e)
    e.set_defaults(func=handler("mariana.apps.asr.commands:evaluate"))
    mark_output(e, "--out", "continue")


def _add_loso_flags(e: argparse.ArgumentParser) -> None:
    """eval's --loso group: the flags of each fold's prepare and train (None: --loso's own defaults)."""
    lo = e.add_argument_group(
        "leave one speaker out (--loso)",
        "For each speaker S: `asr prepare --data DATA --out OUT/S-data --test-speakers S`, "
        "`asr train --data OUT/S-data --out OUT/S TRAIN_ARGS` (a child process, output in OUT/S.log), then "
        "this eval on OUT/S-data/test; one line per fold, the mean and worst WER last, all in OUT/eval.json. "
        "A fold whose data and model were already made with the same settings (OUT/S-data/loso.json, "
        "OUT/S/loso.json) is reused, so an interrupted run resumes; --fresh redoes every fold.",
    )
    lo.add_argument(
        "--loso",
        action="store_true",
        help="leave-one-speaker-out table over the FSDD folder --data (no --model)",
    )
    for flag, kind, text in (
        ("--out", str, "output folder (OUT/<speaker>-data, OUT/<speaker>, OUT/eval.json)"),
        ("--speakers", str, "comma-separated speakers to hold out (default: every speaker in --data)"),
        ("--utterances", int, "prepare's --utterances (default: 150)"),
        ("--max-digits", int, "prepare's --max-digits (default: 5)"),
        ("--seed", int, "prepare's --seed (default: 0)"),
        ("--synth", str, "prepare's --synth (synthetic speakers added to every fold's training set)"),
        ("--synth-ratio", float, "prepare's --synth-ratio (default: prepare's, 1.0)"),
        (
            "--train-args",
            str,
            "flags for every fold's `mariana asr train`, one quoted string (default: '--preset small "
            "--workers 2'); a single flag needs the = form, e.g. --train-args=--spec-augment",
        ),
    ):
        lo.add_argument(flag, type=kind, default=None, help=f"--loso: {text}")
    lo.add_argument(
        "--fresh",
        action="store_true",
        help="--loso: prepare and train every fold again, even if already done",
    )


def _add_transcribe(g) -> None:
    t = g.add_parser(
        "transcribe",
        help="print the transcript of WAV files (each normalised alone, as `eval --cmvn file`)",
        formatter_class=_FMT,
    )
    t.add_argument("--model", required=True, help="run directory of `mariana asr train`")
    _add_decode_flags(t)
    t.add_argument(
        "wavs", nargs="+", help="WAV files; a bad one is reported and skipped, and the exit status is 2"
    )
    t.set_defaults(func=handler("mariana.apps.asr.commands:transcribe"))
