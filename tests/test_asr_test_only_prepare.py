"""Issue 30.10 and the ASR part of 30.12: recordings of one new speaker can be prepared as a test-only
set (to `asr eval` a trained model on them) when that speaker is named in --test-speakers; `asr train`
pointed at raw recordings suggests a separate prepared folder, not `prepare --out` into the raw data."""

import shutil

from cliwalk import run_main


def test_one_new_speaker_becomes_a_test_set(tmp_path, data_dir, capsys):
    rec = tmp_path / "theo-recordings"
    rec.mkdir()
    for d in range(10):  # a new speaker's takes (FSDD names: digit_speaker_take.wav)
        shutil.copyfile(data_dir / "fsdd" / "recordings" / f"{d}_george_0.wav", rec / f"{d}_theo_0.wav")
    out = tmp_path / "theo-data"
    argv = ["asr", "prepare", "--data", rec, "--out", out, "--test-speakers", "theo", "--utterances", "3"]
    rc, stdout, err = run_main(argv, capsys)
    assert rc == 0, err
    assert "train 0 dev 0 test 3" in stdout and "test-only" in stdout, stdout
    assert len((out / "test" / "wav.scp").read_text().splitlines()) == 3
    # without naming the speaker, a folder of one speaker still has no one to train on: refused
    rc, stdout, err = run_main(["asr", "prepare", "--data", rec, "--out", tmp_path / "x"], capsys)
    assert rc == 2 and "no speaker is left for the training set" in err, err


def test_train_on_raw_recordings_suggests_a_separate_folder(tmp_path, data_dir, capsys):
    rec = tmp_path / "recordings"
    rec.mkdir()
    shutil.copyfile(data_dir / "fsdd" / "recordings" / "0_george_0.wav", rec / "0_george_0.wav")
    argv = ["asr", "train", "--data", rec, "--out", tmp_path / "run", "--preset", "debug", "--no-progress"]
    rc, stdout, err = run_main(argv, capsys)
    assert rc == 2 and "no train/wav.scp" in err, err
    assert f"--out {rec} " not in err + " " and "--out recordings-prepared" in err, err
