"""``mariana asr eval --loso``: the leave-one-speaker-out table in one command, run for real (tiny settings,
two speakers of the sample FSDD data) and checked against the separate commands it replaces: each fold's
data equals `asr prepare`'s, each fold's WER equals a separate `asr eval` of its run, the mean is the
folds' average; a second run reuses the trained folds and --fresh retrains; bad input fails in one line.
The command runs in this process (`trained_runs.cli_here`); its folds train in child processes as always."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import assert_cli_error
from trained_runs import cli_here

TINY = ["--utterances", "8", "--max-digits", "2", "--seed", "0"]
TRAIN = "--preset debug --workers 1 --epochs 1"
SPEAKERS = ["george", "jackson"]


def _loso(fsdd: Path, out: Path, *extra: str, speakers: str = "george,jackson", check: bool = True):
    argv = ["asr", "eval", "--loso", "--data", fsdd, "--out", out, "--speakers", speakers, *TINY]
    return cli_here([*argv, "--train-args", TRAIN, *extra], check=check)


def _mtimes(out: Path, speakers) -> dict[str, tuple[int, int]]:
    """(model.safetensors, loso.json) modification times in ns of each fold's run."""
    return {s: ((out / s / "model.safetensors").stat().st_mtime_ns, (out / s / "loso.json").stat().st_mtime_ns)
            for s in speakers}  # fmt: skip


@pytest.fixture(scope="module")
def loso(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("loso")
    proc = _loso(data_dir / "fsdd/recordings", out)
    summary = json.loads((out / "eval.json").read_text())
    return {"out": out, "proc": proc, "summary": summary, "mtimes": _mtimes(out, SPEAKERS)}


def test_loso_folds_match_separate_commands(loso, data_dir, tmp_path):
    from mariana.platform.cli.main import main

    out, s = loso["out"], loso["summary"]
    assert s["speakers"] == SPEAKERS and list(s["folds"]) == SPEAKERS
    for spk in SPEAKERS:
        fold = s["folds"][spk]
        # the fold's data is what `asr prepare` makes with the same flags
        ref = tmp_path / f"{spk}-ref"
        prep = [
            "asr",
            "prepare",
            "--data",
            data_dir / "fsdd/recordings",
            "--out",
            ref,
            "--test-speakers",
            spk,
        ]
        assert main([str(a) for a in [*prep, *TINY]]) == 0
        for split in ("train", "test"):
            for table in ("text", "utt2spk"):
                got = (out / f"{spk}-data" / split / table).read_text()
                assert got == (ref / split / table).read_text(), (spk, split, table)
        test_spk = {line.split()[1] for line in (out / f"{spk}-data/test/utt2spk").read_text().splitlines()}
        train_spk = {line.split()[1] for line in (out / f"{spk}-data/train/utt2spk").read_text().splitlines()}
        assert test_spk == {spk} and spk not in train_spk and len(train_spk) == 4
        # its WER is what a separate `asr eval` of the fold's run says
        ev = cli_here(["asr", "eval", "--model", out / spk, "--data", out / f"{spk}-data/test"], check=True)
        separate = json.loads(Path(fold["result"]).read_text())
        assert (fold["wer"], fold["ser"], fold["utterances"], fold["words"]) == (
            separate["wer"], separate["ser"], separate["utterances"], separate["words"])  # fmt: skip
        assert ev.stdout.strip().splitlines()[-1] == f"WER {fold['wer']:.2f}% SER {fold['ser']:.2f}%"
        assert fold["utterances"] == 8 and fold["trained"] is True
        assert (
            f"fold {spk}: WER {fold['wer']:.2f}% SER {fold['ser']:.2f}% (8 utterances)" in loso["proc"].stdout
        )
        assert "asr train" in (out / f"{spk}.log").read_text()
    wers = [s["folds"][k]["wer"] for k in SPEAKERS]
    assert s["mean_wer"] == pytest.approx(sum(wers) / 2)
    assert s["mean_ser"] == pytest.approx(sum(s["folds"][k]["ser"] for k in SPEAKERS) / 2)
    worst = max(SPEAKERS, key=lambda k: s["folds"][k]["wer"])
    assert s["worst"] == {"speaker": worst, "wer": s["folds"][worst]["wer"]}
    assert s["train_args"] == TRAIN.split()
    assert s["prepare"]["utterances"] == 8 and s["prepare"]["max_digits"] == 2 and s["prepare"]["seed"] == 0
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", s["created"])
    last = loso["proc"].stdout.strip().splitlines()[-1]
    assert last == (f"LOSO mean WER {s['mean_wer']:.2f}% worst {s['worst']['wer']:.2f}% ({worst}) over 2 "
                    f"speakers -> {out / 'eval.json'}")  # fmt: skip


def test_loso_rerun_reuses_and_fresh_retrains(loso, data_dir):
    out, fsdd = loso["out"], data_dir / "fsdd/recordings"
    again = _loso(fsdd, out)
    assert "training" not in again.stdout and again.stdout.count("reusing the model") == 2
    assert _mtimes(out, SPEAKERS) == loso["mtimes"]
    s = json.loads((out / "eval.json").read_text())
    assert [s["folds"][k]["wer"] for k in SPEAKERS] == [loso["summary"]["folds"][k]["wer"] for k in SPEAKERS]
    assert not any(s["folds"][k]["trained"] for k in SPEAKERS)
    fresh = _loso(fsdd, out, "--fresh", speakers="george")
    assert "fold george: training" in fresh.stdout
    after = _mtimes(out, SPEAKERS)
    assert (
        after["george"][0] != loso["mtimes"]["george"][0]
        and after["george"][1] != loso["mtimes"]["george"][1]
    )
    assert after["jackson"] == loso["mtimes"]["jackson"]
    # other train args: that fold is trained again
    changed = cli_here(["asr", "eval", "--loso", "--data", fsdd, "--out", out, "--speakers", "jackson", *TINY,
                        "--train-args", TRAIN + " --lr 0.001"], check=True)  # fmt: skip
    assert "fold jackson: training" in changed.stdout
    assert _mtimes(out, ["jackson"])["jackson"][0] != loso["mtimes"]["jackson"][0]


def test_loso_errors(data_dir, tmp_path, capsys):
    from mariana.platform.cli.main import main

    fsdd = data_dir / "fsdd/recordings"
    base = ["asr", "eval", "--data", fsdd]
    cases = [
        ([*base, "--loso", "--out", tmp_path / "a", "--speakers", "george,bob"],
         ["--speakers: bob not found in --data", "george, jackson, lucas, nicolas, yweweler"]),
        ([*base, "--loso", "--out", tmp_path / "b", "--model", tmp_path], ["--model is not used with --loso"]),
        ([*base], ["--model is required", "--loso"]),
        ([*base, "--loso"], ["--loso needs --out"]),
        ([*base, "--model", tmp_path, "--speakers", "george"], ["--speakers: only used with --loso"]),
        (["asr", "eval", "--loso", "--data", tmp_path, "--out", tmp_path / "c"],
         [f"--data {tmp_path}: no '{{digit}}_{{speaker}}_{{take}}.wav' files", "FSDD recordings folder"]),
        ([*base, "--loso", "--out", tmp_path / "d", "--train-args", "--out x --epochs 1"],
         ["--train-args: --out is set by --loso"]),
        ([*base, "--loso", "--out", tmp_path / "e", "--synth-ratio", "2"], ["--synth-ratio needs --synth"]),
    ]  # fmt: skip
    for argv, fragments in cases:  # in-process: the same `main` the console script runs, without the start-up
        assert main([str(a) for a in argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("mariana: error: ") and err.count("\n") == 1, err
        for f in fragments:
            assert f in err, (f, err)
    # a failing training run (a real child process) names the fold and its log, which keeps its output
    bad = cli_here([*base, "--loso", "--out", tmp_path / "f", "--speakers", "lucas", *TINY,
                    "--train-args", "--preset debug --workers 1 --lr -1"])  # fmt: skip
    log = tmp_path / "f" / "lucas.log"
    assert_cli_error(bad, "fold lucas: `mariana asr train` exited 2", f"log: {log}")
    assert "--lr must be a finite number >= 0" in log.read_text()
    assert not (tmp_path / "f" / "eval.json").exists()
