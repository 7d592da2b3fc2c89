"""``mariana asr eval --loso``: every speaker of an FSDD folder held out in turn (leave one speaker out).

Fold S: prepare ``OUT/S-data`` with S the only test speaker (in-process), train ``OUT/S`` with ``mariana asr
train`` as a child process (output in ``OUT/S.log``), score ``OUT/S-data/test`` (in-process); the folds,
their mean and the worst go to ``OUT/eval.json``. A fold whose markers (``OUT/S-data/loso.json``,
``OUT/S/loso.json`` next to ``model.safetensors``) record the same settings is reused (``--fresh``: redo).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from mariana.platform.core.atomic import atomic_write_text
from mariana.platform.core.errors import DataError, MarianaError
from mariana.platform.core.jsonfile import read_json

from .data import parse_speakers, prepare, scan_fsdd
from .evaluate import evaluate_run, parse_vtln

MARKER = "loso.json"
MODEL_FILE = "model.safetensors"
# Flags the LOSO driver sets itself for every fold's `mariana asr train`.
OWN_TRAIN_FLAGS = ("--data", "--out", "--resume")
# Off a terminal, a child's progress-bar lines (tqdm: "NN%|") are echoed at most this often (all are logged).
PROGRESS_EVERY_S = 10.0


def fsdd_speakers(data: str | Path) -> list[str]:
    """The speakers (sorted) of an FSDD recordings folder ``{digit}_{speaker}_{take}.wav``; DataError
    naming ``--data`` for anything else (a missing path, a file, a Kaldi data dir, a folder without FSDD
    names)."""
    d = Path(data)
    if not d.is_dir():
        what = "is a file" if d.exists() else "no such folder"
        raise DataError(f"--data {data}: {what} (--loso expects an FSDD recordings folder)")
    if (d / "wav.scp").is_file():
        raise DataError(
            f"--data {data}: is a Kaldi data dir; --loso expects an FSDD recordings folder "
            "({digit}_{speaker}_{take}.wav files) to split by speaker"
        )
    speakers = sorted(scan_fsdd(d))
    if not speakers:
        raise DataError(
            f"--data {data}: no '{{digit}}_{{speaker}}_{{take}}.wav' files (--loso expects an FSDD "
            "recordings folder)"
        )
    if len(speakers) < 2:
        raise DataError(
            f"--data {data}: only one speaker ({speakers[0]}); holding a speaker out needs at least two"
        )
    return speakers


def choose_speakers(available: list[str], requested: str | None) -> list[str]:
    """The folds' speakers: ``requested`` (comma-separated, order kept, repeats dropped) or every
    speaker of ``available``; MarianaError naming ``--speakers`` for a speaker not in the data."""
    if not requested:
        return list(available)
    wanted = list(dict.fromkeys(parse_speakers(requested)))
    if not wanted:
        raise MarianaError("--speakers: no speaker given (expected e.g. george,jackson)")
    unknown = [s for s in wanted if s not in available]
    if unknown:
        raise MarianaError(
            f"--speakers: {', '.join(unknown)} not found in --data (speakers: {', '.join(available)})"
        )
    return wanted


def parse_train_args(text: str) -> list[str]:
    """``--train-args`` (shell words) -> argv for `mariana asr train`; the driver's own flags are refused."""
    try:
        words = shlex.split(text or "")
    except ValueError as e:
        raise MarianaError(f"--train-args {text!r}: {e}") from None
    for w in words:
        if w.split("=", 1)[0] in OWN_TRAIN_FLAGS:
            raise MarianaError(
                f"--train-args: {w.split('=', 1)[0]} is set by --loso for each fold (OUT/<speaker>-data, "
                "OUT/<speaker>); leave it out"
            )
    return words


def _train_command() -> list[str]:
    """The `mariana` command as the console script runs it (``mariana.platform.cli.main:run``), with the
    interpreter running this process, so the child uses the same environment."""
    return [sys.executable, "-m", "mariana.platform.cli"]


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 3, 0)] + "..."


def run_train(fold: str, data_dir: Path, run_dir: Path, train_args: list[str], log: Path) -> None:
    """Train one fold as a child ``mariana asr train`` process; its stdout+stderr go to ``log`` and to
    our stdout prefixed ``[fold]`` (on a terminal only the latest line, rewritten in place). A non-zero
    exit raises MarianaError naming the fold, the exit status and the log."""
    cmd = [*_train_command(), "asr", "train", "--data", str(data_dir), "--out", str(run_dir), *train_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # the child's lines arrive as it writes them
    tty = sys.stdout.isatty()
    width = shutil.get_terminal_size().columns - 1
    last, shown = "", float("-inf")
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        # text mode reads '\r' progress updates as line ends too
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                f.write(line)
                line = line.rstrip()
                if not line:
                    continue
                last = line
                if tty:
                    print("\r\033[K" + _fit(f"[{fold}] {line}", width), end="", flush=True)
                elif "%|" not in line or time.monotonic() - shown >= PROGRESS_EVERY_S:
                    # a progress bar redraws many times a second: into a file or pipe, show a few
                    shown = time.monotonic() if "%|" in line else shown
                    print(f"[{fold}] {line}", flush=True)
            rc = proc.wait()
    if tty:
        print("\r\033[K", end="", flush=True)
    if rc != 0:
        raise MarianaError(
            f"fold {fold}: `mariana asr train` exited {rc}" + (f" ({last})" if last else "") + f"; log: {log}"
        )


def _prepare_options(data: str, utterances: int, max_digits: int, seed: int, synth, synth_ratio):
    """-> (what every fold is prepared with, as recorded in its marker; the --synth keywords of
    `data.prepare`, only those given)."""
    synth_kw: dict = {}
    if synth:
        synth_kw["synth"] = str(Path(synth).resolve())
    if synth_ratio is not None:
        synth_kw["synth_ratio"] = synth_ratio
    prep = {
        "data": str(Path(data).resolve()),
        "utterances": utterances,
        "max_digits": max_digits,
        "seed": seed,
        **synth_kw,
    }
    return prep, synth_kw


def _prepare_fold(spk: str, data: str, data_dir: Path, fold_prep: dict, synth_kw: dict, fresh: bool) -> bool:
    """Prepare the fold's data folder (test speaker ``spk``) unless its marker says it was prepared with
    the same ``fold_prep`` (and not ``fresh``) -> True when it was reused."""
    prepared = not fresh and read_json(data_dir / MARKER) == fold_prep
    if not prepared:
        (data_dir / MARKER).unlink(missing_ok=True)
        r = prepare(
            data, data_dir, [spk], [], fold_prep["utterances"], fold_prep["max_digits"], fold_prep["seed"],
            **synth_kw,
        )  # fmt: skip
        atomic_write_text(data_dir / MARKER, json.dumps(fold_prep, indent=2) + "\n")
        print(
            f"fold {spk}: prepared {data_dir}: train {r.counts['train']} test {r.counts['test']} "
            f"utterances, skipped {len(r.skipped)}",
            flush=True,
        )
    return prepared


def _train_fold(spk: str, data_dir: Path, run_dir: Path, log: Path, marker: dict, reuse: bool) -> bool:
    """Train the fold's model into ``run_dir`` unless ``reuse`` (the data was not prepared again) and its
    marker matches ``marker`` (the same data and train args) -> True when it trained."""
    if reuse and (run_dir / MODEL_FILE).is_file() and read_json(run_dir / MARKER) == marker:
        print(f"fold {spk}: reusing the model in {run_dir} (same data and train args; --fresh retrains)")
        return False
    if run_dir.exists() and not run_dir.is_dir():
        raise MarianaError(f"fold {spk}: {run_dir} exists and is not a folder (expected a run dir)")
    # a stale or interrupted run would make `asr train` refuse the folder (or resume it)
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"fold {spk}: training {run_dir} (log: {log})", flush=True)
    run_train(spk, data_dir, run_dir, marker["train_args"], log)
    if not (run_dir / MODEL_FILE).is_file():
        raise MarianaError(f"fold {spk}: training finished without {run_dir / MODEL_FILE}; log: {log}")
    atomic_write_text(run_dir / MARKER, json.dumps(marker, indent=2) + "\n")
    return True


def _summary(
    results: dict[str, dict], folds: list[str], prep: dict, train_words: list[str], eval_kw: dict
) -> dict:
    """``eval.json``'s content: mean WER/SER over the folds, the worst speaker, each fold, and how they
    were made (preparation, train command, eval options, date)."""
    n = len(results)
    worst = max(results, key=lambda s: results[s]["wer"])
    return {
        "speakers": folds,
        "mean_wer": sum(f["wer"] for f in results.values()) / n,
        "mean_ser": sum(f["ser"] for f in results.values()) / n,
        "worst": {"speaker": worst, "wer": results[worst]["wer"]},
        "folds": results,
        "prepare": prep,
        "train_args": train_words,
        "train_command": shlex.join(
            [*_train_command(), "asr", "train", "--data", "OUT/<speaker>-data", "--out", "OUT/<speaker>"]
            + train_words
        ),
        "eval": eval_kw,
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def run_loso(
    data: str,
    out: str,
    speakers: str | None = None,
    utterances: int = 150,
    max_digits: int = 5,
    seed: int = 0,
    synth: str | None = None,
    synth_ratio: float | None = None,
    train_args: str = "--preset small --workers 2",
    beam: int | None = None,
    jobs: int = 2,
    tempo: float | str = "1.0",
    cmvn: str = "speaker",
    fresh: bool = False,
    vtln: float | str = "1.0",
) -> dict:
    """Run every fold and write ``out/eval.json`` -> its content (plus ``path``). The arguments are
    ``mariana asr eval --loso``'s (``vtln`` checked before any fold is prepared); WER and SER are
    percentages, seconds wall-clock per fold and step."""
    parse_vtln(vtln)  # a bad value fails now, not after the first fold's training

    if synth_ratio is not None and not synth:
        raise MarianaError("--synth-ratio needs --synth (the folder of synthetic speakers)")
    available = fsdd_speakers(data)
    folds = choose_speakers(available, speakers)
    train_words = parse_train_args(train_args)
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise MarianaError(f"--out {out}: exists and is not a folder (expected the LOSO output folder)")
    out_dir.mkdir(parents=True, exist_ok=True)
    prep, synth_kw = _prepare_options(data, utterances, max_digits, seed, synth, synth_ratio)

    results: dict[str, dict] = {}
    for spk in folds:
        t0 = time.monotonic()
        data_dir, run_dir, log = out_dir / f"{spk}-data", out_dir / spk, out_dir / f"{spk}.log"
        fold_prep = {**prep, "test_speakers": [spk]}
        marker = {"prepare": fold_prep, "train_args": train_words}
        # data prepared again: the fold's model is retrained on it
        reuse = _prepare_fold(spk, data, data_dir, fold_prep, synth_kw, fresh)
        t1 = time.monotonic()
        trained = _train_fold(spk, data_dir, run_dir, log, marker, reuse)
        t2 = time.monotonic()
        r = evaluate_run(str(run_dir), str(data_dir / "test"), beam, jobs, tempo, cmvn, vtln=vtln)
        t3 = time.monotonic()
        results[spk] = {
            **{k: r[k] for k in ("wer", "ser", "utterances", "words")},
            "run": str(run_dir),
            "data": str(data_dir),
            "result": r["path"],
            "log": str(log),
            "trained": trained,
            "speaker_tempo": r["speaker_tempo"],
            "speaker_vtln": r["speaker_vtln"],
            "seconds": {
                "prepare": round(t1 - t0, 2),
                "train": round(t2 - t1, 2),
                "eval": round(t3 - t2, 2),
                "total": round(t3 - t0, 2),
            },  # fmt: skip
        }
        print(
            f"fold {spk}: WER {r['wer']:.2f}% SER {r['ser']:.2f}% ({r['utterances']} utterances)", flush=True
        )

    eval_kw = {"beam": beam, "jobs": jobs, "tempo": tempo, "cmvn": cmvn, "vtln": vtln}
    summary = _summary(results, folds, prep, train_words, eval_kw)
    path = out_dir / "eval.json"
    atomic_write_text(path, json.dumps(summary, indent=2) + "\n")
    summary["path"] = str(path)
    return summary
