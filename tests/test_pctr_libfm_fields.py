"""Issue 30.4: a libFM line's features are read by their ids, not by their order, when the training
data's ids name their field (Frappe's do): the same features in another order give the same rows in
training, eval, predict and REST (`Predictor.predict_lines`, what the REST route calls), and a line that
lacks fields the training lines all had is refused (it used to be scored, with HTTP 200)."""

import json
import random

import pytest
from cliwalk import run_main
from mariana.apps.pctr.models.predict import load_predictor

ROWS = 300


def _shuffled(line: str, rng: random.Random) -> str:
    label, *feats = line.split()
    rng.shuffle(feats)
    return " ".join([label, *feats])


@pytest.fixture(scope="module")
def files(tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp("fields")
    lines = (data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines()[:ROWS]
    rng = random.Random(0)
    (tmp / "fwd.libfm").write_text("\n".join(lines) + "\n")
    (tmp / "mixed.libfm").write_text("\n".join(lines[:20] + [_shuffled(x, rng) for x in lines[20:]]) + "\n")
    return tmp, lines


def _train(data, out, capsys):
    argv = ["pctr", "train", "--data", data, "--out", out, "--preset", "debug", "--max-steps", "4"]
    rc, _, err = run_main([*argv, "--batch-size", "32", "--no-progress", "--early-stop", "0"], capsys)
    assert rc == 0, err
    return json.loads((out / "metrics.json").read_text())


def test_feature_order_does_not_matter(files, capsys):
    tmp, lines = files
    fwd = _train(tmp / "fwd.libfm", tmp / "run-fwd", capsys)
    mixed = _train(tmp / "mixed.libfm", tmp / "run-mixed", capsys)
    assert mixed["val_auc"] == fwd["val_auc"] and mixed["train_loss"] == fwd["train_loss"]
    assert mixed["skipped_lines"] == 0
    for name in ("fwd", "mixed"):
        rc, out, err = run_main(
            ["pctr", "eval", "--model", tmp / "run-fwd", "--data", tmp / f"{name}.libfm"], capsys
        )
        assert rc == 0, err
    a = json.loads((tmp / "run-fwd" / "eval" / "fwd.json").read_text())
    b = json.loads((tmp / "run-fwd" / "eval" / "mixed.json").read_text())
    assert (a["auc"], a["logloss"], a["rows"]) == (b["auc"], b["logloss"], b["rows"])
    pred = load_predictor(tmp / "run-fwd")
    feats = [x.split(None, 1)[1] for x in lines[:5]]
    rev = [" ".join(reversed(f.split())) for f in feats]
    p_fwd, err_fwd = pred.predict_lines(feats)
    p_rev, err_rev = pred.predict_lines(rev)
    assert not err_fwd and not err_rev and p_fwd == p_rev


def test_line_without_every_field_is_refused(files, capsys):
    tmp, lines = files
    if not (tmp / "run-fwd").is_dir():
        _train(tmp / "fwd.libfm", tmp / "run-fwd", capsys)
    pred = load_predictor(tmp / "run-fwd")
    first = lines[0].split()[1]
    probs, errors = pred.predict_lines([first, lines[1].split(None, 1)[1]])
    assert probs[0] is None and "expected one of each of the 10 fields" in errors[0], errors
    assert probs[1] is not None
    two = lines[0].split()[1:3]  # the user id twice: two features of field 0
    probs, errors = pred.predict_lines([" ".join([two[0], two[0], *lines[0].split()[3:]])])
    assert probs[0] is None and "two features of field 0" in errors[0], errors
