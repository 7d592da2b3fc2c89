"""``mariana asr prepare|train|eval|transcribe`` (stdlib-only imports at module level)."""

from __future__ import annotations

import argparse


def _headline(m: dict) -> str:
    if "eval_wer" in m:
        return f"dev WER {m['eval_wer']:.2f}% SER {m.get('eval_ser', float('nan')):.2f}%"
    return f"train loss {m.get('train_loss', float('nan')):.4f}"


def _prepare(args, argv):
    from mariana.platform.cli.common import check_data_path

    from .data import parse_speakers, prepare

    check_data_path(args.data)
    r = prepare(
        args.data,
        args.out,
        parse_speakers(args.test_speakers),
        parse_speakers(args.dev_speakers),
        args.utterances,
        args.max_digits,
        args.seed,
    )
    if r.skipped:
        print(f"skipped {len(r.skipped)} unreadable recording(s):")
        for path, reason in r.skipped:
            print(f"  {path}: {reason}")
    print(
        f"prepared {args.out}: train {r.counts['train']} dev {r.counts['dev']} test {r.counts['test']} "
        f"utterances, skipped {len(r.skipped)}"
    )
    return 0


def _train(args, argv):
    from mariana.platform.cli.common import run_training

    from .configs import PRESETS, AsrConfig
    from .train import train

    return run_training(args, argv, AsrConfig, PRESETS, train, _headline)


def _check_decode_flags(args) -> None:
    """Flag values checked before torch is imported, so a typo fails at once."""
    from mariana.platform.core.errors import MarianaError

    if args.beam is not None and args.beam < 0:
        raise MarianaError(f"--beam must be >= 0 (0 = greedy), got {args.beam}")
    if getattr(args, "jobs", 1) < 1:
        raise MarianaError(f"--jobs must be >= 1, got {args.jobs}")


def _eval(args, argv):
    from mariana.platform.cli.common import check_data_path

    check_data_path(args.data)
    check_data_path(args.model, "--model")
    _check_decode_flags(args)

    from .evaluate import evaluate_run

    r = evaluate_run(args.model, args.data, args.beam, args.jobs, args.tempo, args.cmvn)
    if r["skipped"]:
        print(f"skipped {r['skipped']} unreadable recording(s): {', '.join(r['skipped_paths'][:5])}")
    tempos = " ".join(f"{k}={v:g}" for k, v in sorted(r["speaker_tempo"].items()))
    print(
        f"utterances {r['utterances']} words {r['words']} beam {r['beam']} tempo {r['tempo']} ({tempos}) "
        f"cmvn {r['cmvn']} -> {r['path']}"
    )
    print(f"WER {r['wer']:.2f}% SER {r['ser']:.2f}%")
    return 0


def _transcribe(args, argv):
    import sys

    from mariana.platform.cli.common import check_data_path
    from mariana.platform.core.errors import MarianaError

    check_data_path(args.model, "--model")
    _check_decode_flags(args)

    from .predict import Transcriber

    t = Transcriber(args.model, beam=args.beam)
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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` only where there is a default to show: not on required flags, nor on
    defaults of None/"" whose help already says what happens."""

    def _get_help_string(self, action):
        if action.required or action.default in (None, "") or action.nargs in ("+", "*"):
            return action.help
        return super()._get_help_string(action)


def register(sub) -> None:
    from mariana.platform.cli.common import add_train_parser

    from .configs import PRESETS, AsrConfig

    fmt = _HelpFormatter
    grp = sub.add_parser(
        "asr", help="speech recognition: connected-digit acoustic DNN with CTC (data parallel)"
    )
    g = grp.add_subparsers(dest="asr_command", required=True, metavar="COMMAND")

    p = g.add_parser(
        "prepare",
        help="build Kaldi data dirs OUT/{train,dev,test} of connected-digit utterances",
        formatter_class=fmt,
    )
    p.add_argument("--data", required=True, help="FSDD recordings folder or a Kaldi data dir")
    p.add_argument("--out", required=True, help="output folder for train/, dev/, test/")
    p.add_argument(
        "--test-speakers", default="", help="comma-separated test speakers (default: last speaker)"
    )
    p.add_argument("--dev-speakers", default="", help="comma-separated dev speakers (default: none)")
    p.add_argument("--utterances", type=int, default=200, help="connected-digit utterances per speaker")
    p.add_argument("--max-digits", type=int, default=7, help="most digits per utterance")
    p.add_argument("--seed", type=int, default=0, help="random seed (digit order, pauses, noise)")
    p.set_defaults(func=_prepare)

    add_train_parser(
        g, "train", AsrConfig, "train the acoustic DNN with CTC (--workers N data parallel)", _train, PRESETS
    )

    e = g.add_parser(
        "eval",
        help="WER/SER of a trained run on a Kaldi data dir; writes RUN/eval/<data name>.json",
        formatter_class=fmt,
    )
    e.add_argument("--model", required=True, help="run directory of `mariana asr train`")
    e.add_argument("--data", required=True, help="Kaldi data dir to score, e.g. OUT/test")
    e.add_argument(
        "--beam", type=int, default=None, help="prefix beam width >= 0 (default: the run's --beam; 0 greedy)"
    )
    e.add_argument("--jobs", type=int, default=2, help="parallel feature threads (>= 1)")
    e.add_argument(
        "--tempo",
        default="1.0",
        help="speaking-rate normalisation: frames every 10 x TEMPO ms, so a speaker TEMPO times slower "
        "than the training speakers is heard at their pace (pitch unchanged); 'auto' picks each "
        "speaker's factor in 0.8..1.2 where the model is most confident (no transcripts used)",
    )
    e.add_argument(
        "--cmvn",
        default="speaker",
        choices=["speaker", "file"],
        help="feature normalisation: 'speaker' = each speaker's statistics over --data (as in training); "
        "'file' = each file alone with the training speakers' prior, exactly as `transcribe` and the "
        "server do (their transcripts are this mode's hypotheses)",
    )
    e.set_defaults(func=_eval)

    t = g.add_parser(
        "transcribe",
        help="print the transcript of WAV files (each normalised alone, as `eval --cmvn file`)",
        formatter_class=fmt,
    )
    t.add_argument("--model", required=True, help="run directory of `mariana asr train`")
    t.add_argument("--data", default="", help="unused; WAV files are given as arguments")
    t.add_argument(
        "--beam", type=int, default=None, help="prefix beam width >= 0 (default: the run's --beam; 0 greedy)"
    )
    t.add_argument(
        "wavs", nargs="+", help="WAV files; a bad one is reported and skipped, and the exit status is 2"
    )
    t.set_defaults(func=_transcribe)
