"""Issue 30.3 for asr, vision and serve: a flag that would change nothing is refused (exit 2, one line
naming it and what it needs), not silently ignored. The flags documented as "unused" are gone; flags of
the non-config commands that apply only with another one are refused without it (in-process, before any
data is read or written)."""

from __future__ import annotations

import pytest
from cliwalk import leaf_parsers, option, run_main

FSDD = "../shared/data/fsdd/recordings"


@pytest.mark.parametrize(
    "command", [("asr", "synth"), ("asr", "transcribe"), ("vision", "classify"), ("serve",)], ids=" ".join
)
def test_unused_data_flags_are_gone(command):
    parser = dict(leaf_parsers())[command]
    assert option(parser, "--data") is None, f"mariana {' '.join(command)} still takes an unused --data"


def test_unused_data_flag_is_refused_by_the_parser(tmp_path, capsys):
    rc, _, err = run_main(["vision", "classify", "--model", tmp_path, "--data", tmp_path, "x.jpg"], capsys)
    assert rc == 2 and "unrecognized arguments: --data" in err


@pytest.mark.parametrize(
    "argv,needs",
    [
        (["asr", "prepare", "--data", FSDD, "--out", "{tmp}/p", "--synth-ratio", "2"], "--synth-ratio applies to runs with --synth"),
        (["serve", "--pctr", "{tmp}/run", "--watch-interval", "0.5"], "--watch-interval applies to --watch"),
    ],
    ids=["asr prepare --synth-ratio", "serve --watch-interval"],
)  # fmt: skip
def test_flag_without_the_flag_it_needs_is_refused(argv, needs, tmp_path, capsys):
    rc, out, err = run_main([a.format(tmp=tmp_path) for a in argv], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("mariana: error: ") and needs in lines[0], err
    assert not (tmp_path / "p").exists(), "refused before anything was written"


def test_synth_ratio_applies_with_synth(tmp_path, capsys):
    """--synth-ratio with --synth gets past that check (to the missing synth folder's own error)."""
    rc, _, err = run_main(
        [
            "asr",
            "prepare",
            "--data",
            FSDD,
            "--out",
            tmp_path / "p",
            "--synth",
            tmp_path / "none",
            "--synth-ratio",
            "2",
        ],
        capsys,
    )
    assert rc == 2 and "--synth-ratio" not in err and "none" in err


# ---------------------------------------------------------------- asr train, vision train: from the sections
def _config_cases():
    """(command, field, clause) for every condition declared by asr's and vision's train sections."""
    from mariana.apps.asr.configs import AsrConfig
    from mariana.apps.vision.configs import VisionConfig

    return [
        (command, cls, name, clause)
        for command, cls in ((("asr", "train"), AsrConfig), (("vision", "train"), VisionConfig))
        for name, clauses in sorted(cls.CLAUSES.items())
        for clause in clauses
    ]


CONFIG_CASES = _config_cases()


def _flag_args(cls, name: str, value, path: str) -> list[str]:
    """The command-line form of ``field = value``; ``None`` (a `given` clause's holding value): on for a
    switch, an existing path for a path, a loopback endpoint for --rdzv-endpoint."""
    import dataclasses

    from mariana.platform.core.config import flag

    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if isinstance(f.default, bool):
        value = value is None or bool(value)
    elif value is None:
        if not f.metadata.get("path"):
            assert name == "rdzv_endpoint", f"no value for --{flag(name)} set"
            value = "127.0.0.1:29500"
    if isinstance(value, bool):
        return [f"--{flag(name)}" if value else f"--no-{flag(name)}"]
    if isinstance(value, list):
        return [f"--{flag(name)}", ",".join(str(v) for v in value)]
    return [f"--{flag(name)}", path if value is None else str(value)]


def _argv(command, cls, name, setting: dict, path: str) -> list[str]:
    """``mariana COMMAND`` with ``--NAME`` given explicitly at its default value plus ``setting``."""
    import dataclasses

    from config_probe import default_of

    default = default_of({f.name: f for f in dataclasses.fields(cls)}[name])
    argv = [*command, "--data", path, "--workers", "2", *_flag_args(cls, name, default, path)]
    for field, value in setting.items():
        argv += _flag_args(cls, field, value, path)
    return argv


def test_the_inert_flags_of_the_issue_are_declared():
    """The flags issue 30.3 and the inert-flag runs found (bit-identical weights without them) have a
    condition: vision --micro-batches/--stage-balance/--pipeline-schedule (pipeline only), --dropout
    (mariana-cnn only), --cache-gb (--cache auto), --eval-limit/--eval-tta/--eval-every/--monitor/
    --early-stop (--eval-data), --schedule/--warmup-steps (recipe standard); asr --num-ceps (mfcc),
    --stretch-segment (--time-stretch), SpecAugment masks, --compile-backend, --lm-weight/--word-bonus
    (--beam >= 1)."""
    declared = {(c[0], n) for c, _, n, _ in CONFIG_CASES}
    vision = "micro_batches stage_balance pipeline_schedule dropout cache_gb eval_limit eval_tta eval_every monitor early_stop schedule warmup_steps compile"
    asr = "num_ceps stretch_segment freq_mask time_mask num_masks compile_backend lm_weight word_bonus pitch_perturb"
    expected = {("vision", n) for n in vision.split()} | {("asr", n) for n in asr.split()}
    assert expected <= declared, sorted(expected - declared)


@pytest.mark.parametrize(
    "command,cls,name,clause",
    CONFIG_CASES,
    ids=[f"{' '.join(c)} --{n} needs {k.field}" for c, _, n, k in CONFIG_CASES],
)
def test_a_flag_whose_condition_fails_is_refused(command, cls, name, clause, tmp_path):
    """``--NAME DEFAULT`` (even the default value, typed) with the clause's field at a value that fails
    it is refused in one line naming both; with every clause of the field holding it is accepted."""
    from config_probe import witnesses
    from mariana.platform.cli.main import check_command
    from mariana.platform.core.config import flag
    from mariana.platform.core.errors import MarianaError

    holding = {c.field: witnesses(cls, c, tmp_path)[0] for c in cls.CLAUSES[name]}
    check_command(_argv(command, cls, name, holding, str(tmp_path)))  # applies: no error at all
    failing = {**holding, clause.field: witnesses(cls, clause, tmp_path)[1]}
    with pytest.raises(MarianaError) as e:
        check_command(_argv(command, cls, name, failing, str(tmp_path)))
    typed = (f"--{flag(name)}", f"--no-{flag(name)}")  # a switch is named as it was typed
    assert str(e.value).startswith(tuple(f"{t} applies to {clause.text}" for t in typed)), str(e.value)
