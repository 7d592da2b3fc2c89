"""Issue 31 (configs in sections) and issue 30.3 (no flag that changes nothing), tested over the whole CLI.

The cases are generated from the `mariana` parser: every registered command whose config is composed of
sections, and every field of it with an applies-condition. For each condition, a command line where it
fails must be refused (exit 2, one line naming the flag and the condition) and the same flag where it
holds must be accepted (`check_command`: parse + resolve + validate, no training)."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
from config_probe import default_of, load_config, witnesses
from helpers import cli_env
from mariana.platform.cli.main import build_parser, check_command
from mariana.platform.core.config import (
    MAX_FIELDS,
    Config,
    Section,
    add_config_args,
    flag,
    opt,
    read_config_values,
    resolve_config,
    save_config,
    saved_run_values,
)
from mariana.platform.core.errors import MarianaError


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, leaf parser) for every command of ``parser``."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _commands(sub, (*path, name))


PARSER = build_parser()
COMPOSED = {
    path: p.get_default("_config")[0]
    for path, p in _commands(PARSER)
    if p.get_default("_config") and getattr(p.get_default("_config")[0], "SECTIONS", ())
}


def _cases():
    out = []
    for path, cls in COMPOSED.items():
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name, clauses in cls.CLAUSES.items():
            if not fields[name].metadata.get("cli", True):
                continue
            for k, clause in enumerate(clauses):
                out.append(
                    pytest.param(path, cls, name, k, id=f"{' '.join(path)}--{flag(name)}-{clause.field}")
                )
    return out


CASES = _cases()


def _flag_args(name: str, value: Any) -> list[str]:
    if isinstance(value, bool):
        return [f"--{flag(name)}" if value else f"--no-{flag(name)}"]
    if value is None:
        return [f"--{flag(name)}", "none"]
    if isinstance(value, list):
        return [f"--{flag(name)}", ",".join(str(v) for v in value)]
    return [f"--{flag(name)}", str(value)]


def _holding(cls, name: str, values: dict, tmp: Path, skip: int | None = None) -> None:
    """Add to ``values`` what makes every clause of ``name`` (but clause ``skip``) hold, recursively for the
    fields those clauses set (values already chosen are kept)."""
    for k, clause in enumerate(cls.CLAUSES.get(name, ())):
        if k == skip or clause.field in values:
            continue
        on, _ = witnesses(cls, clause, tmp)
        if on is not None and on == _default(cls, clause.field):
            continue  # holds without typing it (typing it could meet that field's own conditions)
        values[clause.field] = str(tmp) if on is None else on
        for field, v in clause.also:
            values.setdefault(field, str(tmp) if v is None else v)
        _holding(cls, clause.field, values, tmp)


def _argv(path, cls, values: dict, tmp: Path) -> list[str]:
    argv = list(path)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, f in fields.items():  # what the command requires (and `check_command` asks of --data)
        if name not in values and (f.metadata.get("required") or name == "data"):
            values[name] = str(tmp)
    for name, value in values.items():
        argv += _flag_args(name, value)
    return argv


def _default(cls, name: str) -> Any:
    return default_of({f.name: f for f in dataclasses.fields(cls)}[name])


def _value(cls, name: str, clause_also: dict) -> Any:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return clause_also.get(name, default_of(f))


@pytest.mark.parametrize("path, cls, name, k", CASES)
def test_a_flag_is_refused_where_it_does_not_apply_and_accepted_where_it_does(path, cls, name, k, tmp_path):
    clause = cls.CLAUSES[name][k]
    also = {f: (str(tmp_path) if v is None else v) for c in cls.CLAUSES[name] for f, v in c.also}
    on, off = witnesses(cls, clause, tmp_path)
    # where the condition fails (every other condition of the field holding): one line, exit 2
    values = {name: _value(cls, name, also)}
    _holding(cls, name, values, tmp_path, skip=k)
    values[clause.field] = off
    _holding(cls, clause.field, values, tmp_path)
    values[clause.field] = off
    with pytest.raises(MarianaError) as refused:
        check_command(_argv(path, cls, dict(values), tmp_path))
    line = str(refused.value)
    assert refused.value.exit_code == 2 and "\n" not in line
    assert f" applies to {clause.text} (this run" in line, line
    # the flag named is this one, or (when this one needs another flag the same condition governs, e.g.
    # --rdzv-id needs --rdzv-endpoint, both parameter-server flags) that one
    named = line.split(" applies to ")[0].removeprefix("--no-").removeprefix("--").replace("-", "_")
    governed = {n for n, cs in cls.CLAUSES.items() if any(c is clause for c in cs)}
    assert named == name or (named in governed and named in values), line
    # where it holds: the same flag is accepted
    values = {name: _value(cls, name, also)}
    _holding(cls, name, values, tmp_path)
    check_command(_argv(path, cls, values, tmp_path))


def test_the_generated_cases_cover_every_app_with_conditions():
    """The issue's examples are among the generated cases (and so is every app's train command)."""
    covered = {(" ".join(p), flag(n), c.field) for p, cls, n, k in (case.values for case in CASES)
               for c in [cls.CLAUSES[n][k]]}  # fmt: skip
    for example in [
        ("pctr train", "ftrl-l1", "sparse_optimizer"),
        ("pctr train", "cross-layers", "model"),
        ("pctr train", "hidden", "model"),
        ("pctr train", "staleness", "servers"),
        ("pctr train", "pull-ahead", "servers"),
        ("pctr train", "admit-after", "ids"),
        ("pctr stream", "ftrl-l1", "sparse_optimizer"),
        ("mlp train", "momentum", "optimizer"),
        ("pctr drift-logs", "drift", "days"),
    ]:
        assert example in covered, example
    assert {p[0] for p in COMPOSED} >= {"pctr", "mlp"}


def test_the_issue_example_exits_2_with_one_line(tmp_path):
    """`--ftrl-l1` with the default Adagrad rows ran and reported the baseline's AUC before the rule."""
    p = subprocess.run(
        [sys.executable, "-m", "mariana.platform.cli", "pctr", "train", "--data", tmp_path, "--ftrl-l1", "0.1"],
        capture_output=True, text=True, env=cli_env(), timeout=120,
    )  # fmt: skip
    assert p.returncode == 2 and p.stderr.splitlines() == [
        "mariana: error: --ftrl-l1 applies to --sparse-optimizer ftrl only (this run: --sparse-optimizer adagrad)"
    ], p.stderr


def _resolve(cls, argv):
    p = argparse.ArgumentParser()
    add_config_args(p, cls)
    return resolve_config(cls, p.parse_args(argv))


def test_flat_toml_is_read_with_one_deprecation_line_and_sectioned_toml_without(tmp_path, capsys):
    from mariana.apps.pctr.configs import PctrConfig

    flat = tmp_path / "flat.toml"
    flat.write_text('lr = 0.01\nmodel = "fm"\n')
    cfg = _resolve(PctrConfig, ["--config", str(flat)])
    assert (cfg.lr, cfg.model) == (0.01, "fm")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "flat config file" in err[0] and "deprecated" in err[0] and str(flat) in err[0]
    sectioned = tmp_path / "sectioned.toml"
    sectioned.write_text('[optim]\nlr = 0.01\n\n[net]\nmodel = "fm"\n')
    cfg = _resolve(PctrConfig, ["--config", str(sectioned), "--lr", "0.02"])
    assert (cfg.lr, cfg.model) == (0.02, "fm") and capsys.readouterr().err == ""  # flags win over TOML
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("[net]\nlr = 0.01\n")
    with pytest.raises(MarianaError, match=r"field 'lr' belongs in section \[optim\], not \[net\]"):
        _resolve(PctrConfig, ["--config", str(wrong)])
    inert = tmp_path / "inert.toml"
    inert.write_text("[table]\nftrl_l1 = 0.5\n")
    with pytest.raises(MarianaError, match=r"field 'ftrl_l1': --ftrl-l1 applies to --sparse-optimizer ftrl"):
        _resolve(PctrConfig, ["--config", str(inert)])


def test_run_config_is_written_by_sections_and_old_flat_ones_are_read_quietly(tmp_path, capsys):
    from mariana.apps.pctr.configs import PctrConfig

    cfg = PctrConfig(out=str(tmp_path / "new"), lr=0.02, model="lr")
    save_config(cfg, tmp_path / "config.toml")
    text = (tmp_path / "config.toml").read_text()
    assert "[optim]\n" in text and "[net]\n" in text and "\nlr = 0.02\n" in text
    assert "hidden" not in text and "ftrl_l1" not in text  # what did not apply to this run is left out
    assert load_config(PctrConfig, tmp_path / "config.toml") == cfg
    old = tmp_path / "old"  # an earlier version's run: flat, with fields pCTR no longer declares
    old.mkdir()
    (old / "config.toml").write_text('lr = 0.03\nmodel = "fm"\ngrad_comm = "fp32"\nmomentum = 0.9\n')
    values = saved_run_values(PctrConfig, {"resume": True, "out": str(old)}, {})
    assert values == {"lr": 0.03, "model": "fm"} and read_config_values(old / "config.toml")["lr"] == 0.03
    assert load_config(PctrConfig, old / "config.toml").lr == 0.03 and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "path", sorted(p for p, cls in COMPOSED.items() if "SECTIONS" in vars(cls)), ids=" ".join
)
def test_help_groups_the_flags_by_section(path):
    cls = COMPOSED[path]
    parser = dict(_commands(PARSER))[path]
    text = parser.format_help()
    for s in cls.SECTIONS:
        if any(f.metadata.get("cli", True) for f in dataclasses.fields(s)):
            assert f"\n[{s.NAME}] {s.TITLE}:\n" in text, (s.NAME, text)
            for f in dataclasses.fields(s):  # the section's flags are listed under its title
                group = text.split(f"\n[{s.NAME}] {s.TITLE}:\n")[1].split("\n\n")[0]
                assert not f.metadata.get("cli", True) or f"--{flag(f.name)}" in group, (s.NAME, f.name)


def test_no_section_over_the_limit_and_names_unique_in_a_composition():
    for cls in COMPOSED.values():
        for s in cls.SECTIONS:
            assert len(dataclasses.fields(s)) <= MAX_FIELDS, (cls.__name__, s.NAME)

    def section(name: str, n: int, prefix: str = "f"):
        ns = {"NAME": name, "TITLE": name, "__annotations__": {"NAME": ClassVar[str], "TITLE": ClassVar[str]}}
        for i in range(n):
            ns["__annotations__"][f"{prefix}{i}"] = int
            ns[f"{prefix}{i}"] = opt(0, "x")
        return dataclass(type(f"S{name}", (Section,), ns))

    with pytest.raises(AssertionError, match="at most 30"):
        type("Big", (Config,), {}, sections=(section("big", MAX_FIELDS + 1),))
    with pytest.raises(AssertionError, match="is in sections a and b"):
        type("Twice", (Config,), {}, sections=(section("a", 2), section("b", 1)))
    type("Fine", (Config,), {}, sections=(section("a", MAX_FIELDS), section("b", 1, "g")))
