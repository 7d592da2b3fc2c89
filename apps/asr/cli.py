"""``mariana asr prepare|train|eval|transcribe`` (stdlib-only imports at module level)."""

from __future__ import annotations

import argparse
import sys

from mariana.platform.cli.console import warn_skipped


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
        args.synth or None,
        args.synth_ratio,
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


def _synth(args, argv):
    from .synth import synthesize

    r = synthesize(args.out, args.speakers, args.takes, args.seed, args.sample_rate, jobs=args.jobs)
    for path, reason in r.skipped[:10]:
        print(f"  skipped {path}: {reason}")
    print(
        f"synthesised {args.out}: {r.speakers} speakers, {r.files} files ({r.generated} generated, "
        f"{r.files - r.generated} from the cache, {r.regenerated} unreadable cached files regenerated), "
        f"skipped {len(r.skipped)}"
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
    if args.lm_weight is not None and args.lm_weight < 0:
        raise MarianaError(f"--lm-weight must be >= 0 (0 = no language model), got {args.lm_weight}")
    if getattr(args, "jobs", 1) < 1:
        raise MarianaError(f"--jobs must be >= 1, got {args.jobs}")


_LOSO_ONLY = ("out", "speakers", "utterances", "max_digits", "seed", "synth", "synth_ratio", "train_args")


def _eval_loso(args) -> int:
    """``eval --loso``: every speaker of an FSDD folder held out in turn (`loso.run_loso`)."""
    from .loso import run_loso

    r = run_loso(
        args.data,
        args.out,
        speakers=args.speakers,
        utterances=150 if args.utterances is None else args.utterances,
        max_digits=5 if args.max_digits is None else args.max_digits,
        seed=0 if args.seed is None else args.seed,
        synth=args.synth,
        synth_ratio=args.synth_ratio,
        train_args="--preset small --workers 2" if args.train_args is None else args.train_args,
        beam=args.beam,
        jobs=args.jobs,
        tempo=args.tempo,
        cmvn=args.cmvn,
        vtln=args.vtln,
        fresh=args.fresh,
    )
    w = r["worst"]
    print(
        f"LOSO mean WER {r['mean_wer']:.2f}% worst {w['wer']:.2f}% ({w['speaker']}) over "
        f"{len(r['folds'])} speakers -> {r['path']}"
    )
    return 0


def _eval(args, argv):
    from mariana.platform.cli.common import check_data_path
    from mariana.platform.core.errors import MarianaError

    check_data_path(args.data)
    if args.loso:
        if args.model:
            raise MarianaError(
                "--model is not used with --loso (each fold trains its own model in OUT/<speaker>)"
            )
        if not args.out:
            raise MarianaError("--loso needs --out (the folder for every fold's data, run and eval.json)")
        _check_decode_flags(args)
        if args.lm_weight is not None or args.word_bonus is not None:
            raise MarianaError(
                "--lm-weight/--word-bonus are not used with --loso (pass them in --train-args: each fold's "
                "run then decodes with them)"
            )
        return _eval_loso(args)
    if not args.model:
        raise MarianaError("--model is required (a run directory of `mariana asr train`), or pass --loso")
    given = [k for k in _LOSO_ONLY if getattr(args, k) is not None] + (["fresh"] if args.fresh else [])
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise MarianaError(f"{flags}: only used with --loso")
    check_data_path(args.model, "--model")
    _check_decode_flags(args)

    from .evaluate import evaluate_run

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


def _transcribe(args, argv):
    import sys

    from mariana.platform.cli.common import check_data_path
    from mariana.platform.core.errors import MarianaError

    check_data_path(args.model, "--model")
    _check_decode_flags(args)

    from .predict import Transcriber

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


def _add_lm_flags(p) -> None:
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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` only where there is a default to show: not on required flags, nor on
    defaults of None/"" whose help already says what happens."""

    def _get_help_string(self, action):
        if action.required or action.default in (None, "") or action.nargs in ("+", "*"):
            return action.help
        return super()._get_help_string(action)


def register(sub) -> None:
    from mariana.platform.cli.common import add_train_parser
    from mariana.platform.cli.outputs import mark_output

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
    p.add_argument(
        "--synth", default="", help="folder of synthetic speakers (`mariana asr synth`) added to training"
    )
    p.add_argument(
        "--synth-ratio",
        type=float,
        default=1.0,
        help="synthetic training utterances per real training utterance (shared by the synthetic speakers)",
    )
    p.set_defaults(func=_prepare)
    mark_output(p, "--out", "never")

    y = g.add_parser(
        "synth",
        help="synthesise digit speakers with a text-to-speech engine (eSpeak NG) into an FSDD-layout folder",
        formatter_class=fmt,
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
    y.add_argument("--data", default="", help="unused; synth needs no input data")
    y.set_defaults(func=_synth)
    mark_output(y, "--out", "continue")

    t = add_train_parser(
        g, "train", AsrConfig, "train the acoustic DNN with CTC (--workers N data parallel)", _train, PRESETS
    )
    mark_output(t, "--cache", "continue", "asr feature cache")

    e = g.add_parser(
        "eval",
        help="WER/SER of a trained run on a Kaldi data dir; writes RUN/eval/<data name>.json "
        "(--loso: every speaker held out in turn, prepared, trained and scored; writes OUT/eval.json)",
        formatter_class=fmt,
    )
    e.add_argument(
        "--model", default="", help="run directory of `mariana asr train` (required unless --loso)"
    )
    e.add_argument(
        "--data",
        required=True,
        help="Kaldi data dir to score, e.g. OUT/test; with --loso the FSDD recordings folder",
    )
    e.add_argument(
        "--beam", type=int, default=None, help="prefix beam width >= 0 (default: the run's --beam; 0 greedy)"
    )
    _add_lm_flags(e)
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
    lo.add_argument(
        "--out", default=None, help="--loso: output folder (OUT/<speaker>-data, OUT/<speaker>, OUT/eval.json)"
    )
    lo.add_argument(
        "--speakers",
        default=None,
        help="--loso: comma-separated speakers to hold out (default: every speaker in --data)",
    )
    lo.add_argument(
        "--utterances", type=int, default=None, help="--loso: prepare's --utterances (default: 150)"
    )
    lo.add_argument(
        "--max-digits", type=int, default=None, help="--loso: prepare's --max-digits (default: 5)"
    )
    lo.add_argument("--seed", type=int, default=None, help="--loso: prepare's --seed (default: 0)")
    lo.add_argument(
        "--synth",
        default=None,
        help="--loso: prepare's --synth (synthetic speakers added to every fold's training set)",
    )
    lo.add_argument(
        "--synth-ratio",
        type=float,
        default=None,
        help="--loso: prepare's --synth-ratio (default: prepare's, 1.0)",
    )
    lo.add_argument(
        "--train-args",
        default=None,
        help="--loso: flags for every fold's `mariana asr train`, one quoted string (default: '--preset small "
        "--workers 2'); a single flag needs the = form, e.g. --train-args=--spec-augment",
    )
    lo.add_argument(
        "--fresh",
        action="store_true",
        help="--loso: prepare and train every fold again, even if already done",
    )
    e.set_defaults(func=_eval)
    mark_output(e, "--out", "continue")

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
    _add_lm_flags(t)
    t.add_argument(
        "wavs", nargs="+", help="WAV files; a bad one is reported and skipped, and the exit status is 2"
    )
    t.set_defaults(func=_transcribe)
