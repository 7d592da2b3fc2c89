"""Issue 41 point 3: flags that change nothing, judged from the run's own state, are refused the same way in
every app and in TOML. The conditions are declared on the sections (``applies=``; ``VALIDATES`` stands for
each composition's ``VALIDATION``: pctr's --split, vision's --eval-data, a dev set in asr's --data folder,
looked at without reading it); the cases below are generated over every condition of every composed command,
here for a TOML file (test_config_sections.py generates the same for flags), plus the issue's examples."""

from __future__ import annotations

import json

import pytest
from cliwalk import run_main
from mariana.platform.cli.main import check_command
from mariana.platform.core.config import flag
from mariana.platform.core.errors import MarianaError
from test_config_sections import CASES, _argv, _holding, _value

FRAPPE = "../shared/data/frappe/frappe.validation.libfm"


def _toml_value(value) -> str:
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()


# the commands that read a --config file; TOML has no "none" for an optional field left unset
TOML_CASES = [
    c
    for c in CASES
    if "config" in c.values[1].SECTION_OF and _value(c.values[1], c.values[2], {}) is not None
]


@pytest.mark.parametrize("path, cls, name, k", TOML_CASES)
def test_a_toml_value_is_refused_where_its_condition_fails(path, cls, name, k, tmp_path):
    """``[section] NAME = default`` in a --config file, the condition's field failing on the command line:
    one line naming the file, the field and the condition; with the condition holding it is accepted."""
    from config_probe import witnesses

    clause = cls.CLAUSES[name][k]
    also = {f: (str(tmp_path) if v is None else v) for c in cls.CLAUSES[name] for f, v in c.also}
    on, off = witnesses(cls, clause, tmp_path)
    values = {name: _value(cls, name, also)}
    _holding(cls, name, values, tmp_path, skip=k)
    values[clause.field] = off
    _holding(cls, clause.field, values, tmp_path)
    values[clause.field] = off
    toml = tmp_path / "job.toml"
    toml.write_text(f"[{cls.SECTION_OF[name]}]\n{name} = {_toml_value(values.pop(name))}\n")
    with pytest.raises(MarianaError) as refused:
        check_command([*_argv(path, cls, values, tmp_path), "--config", str(toml)])
    line = str(refused.value)
    assert f" applies to {clause.text} (this run" in line and "\n" not in line, line
    # the file and field are named, unless (as with flags) a flag this one needs is what is refused
    assert line.startswith(f"{toml}: field '{name}': ") or " applies to " in line.split(": ")[0], line
    values = {name: _value(cls, name, also)}
    _holding(cls, name, values, tmp_path)
    toml.write_text(f"[{cls.SECTION_OF[name]}]\n{name} = {_toml_value(values.pop(name))}\n")
    check_command([*_argv(path, cls, values, tmp_path), "--config", str(toml)])


def _asr_data(root, dev: bool):
    """A prepared-looking ASR folder: DATA/train/wav.scp and, with ``dev``, DATA/dev/wav.scp."""
    for split in ("train", "dev") if dev else ("train",):
        (root / split).mkdir(parents=True)
        (root / split / "wav.scp").write_text("u1 a.wav\n")
    return root


@pytest.mark.parametrize("extra", [["--eval-every", "5"], ["--early-stop", "2"], ["--monitor", "auc"],
                                   ["--val-rows", "10"]], ids=" ".join)  # fmt: skip
def test_pctr_without_validation_rows_refuses_the_validation_flags(extra, tmp_path, capsys):
    argv = ["pctr", "train", "--data", FRAPPE, "--split", "1,0,0", "--out", tmp_path / "run", *extra]
    rc, _, err = run_main(argv, capsys)
    assert rc == 2 and err.splitlines() == [
        f"mariana: error: {extra[0]} applies to runs with validation rows (--split T,V,E with V > 0) "
        "(this run: --split 1,0,0)"
    ], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra", [["--eval-every", "5"], ["--early-stop", "2"], ["--monitor", "wer"]],
                         ids=" ".join)  # fmt: skip
def test_asr_without_a_dev_set_refuses_the_validation_flags_alike(extra, tmp_path, capsys):
    data = _asr_data(tmp_path / "data", dev=False)
    rc, _, err = run_main(["asr", "train", "--data", data, "--out", tmp_path / "run", *extra], capsys)
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"{extra[0]} applies to a --data with a dev set (DATA/dev/wav.scp)" in err, err
    check_command(["asr", "train", "--data", str(_asr_data(tmp_path / "dev", dev=True)), *extra])


def test_epochs_with_max_steps_and_another_preset_on_resume_are_refused(tmp_path, capsys):
    rc, _, err = run_main(
        ["vision", "train", "--data", tmp_path, "--epochs", "3", "--max-steps", "1"], capsys
    )
    assert rc == 2 and "--epochs applies to runs without --max-steps (this run: --max-steps 1)" in err, err
    run = tmp_path / "run"
    train = [
        "mlp",
        "train",
        "--data",
        FRAPPE,
        "--out",
        run,
        "--max-steps",
        "2",
        "--limit",
        "500",
        "--no-progress",
    ]
    assert run_main([*train, "--preset", "debug"], capsys)[0] == 0
    rc, _, err = run_main([*train, "--resume", "--max-steps", "3", "--preset", "small"], capsys)
    assert rc == 2 and err.splitlines() == [
        "mariana: error: --preset applies to new runs, or a --resume of a run made with it (this run: --resume on)"
    ], err
    # the first command repeated with --resume (what the job service's retry does) is accepted
    assert run_main([*train, "--preset", "debug", "--resume", "--max-steps", "3"], capsys)[0] == 0


def test_every_composed_train_command_has_the_loop_conditions():
    covered = {(" ".join(p), flag(n)) for p, cls, n, k in (c.values for c in CASES)}
    for cmd in ("pctr train", "asr train", "vision train", "mlp train"):
        assert {(cmd, "epochs"), (cmd, "preset")} <= covered, cmd
    for cmd in ("pctr train", "asr train", "vision train"):
        assert {(cmd, "eval-every"), (cmd, "early-stop"), (cmd, "monitor")} <= covered, cmd
    assert ("pctr train", "val-rows") in covered
