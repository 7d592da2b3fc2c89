"""Unit tests of the training core: config layers and type checks, atomic writes, export, sampler, LR."""

import argparse
import dataclasses

import pytest
import torch
from config_probe import load_config
from mariana.platform.core.atomic import atomic_torch_save, atomic_write_text
from mariana.platform.core.config import (
    TrainConfig,
    add_config_args,
    resolve_config,
    save_config,
)
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.export import export_model, load_exported
from mariana.platform.core.optim import lr_factor
from mariana.platform.core.rundir import check_resume_config, resume_differences
from mariana.platform.dp.sampler import ShardedBatchSampler
from mariana.platform.runtime.dist import ParallelDims


def parse(argv, presets=None):
    p = argparse.ArgumentParser()
    add_config_args(p, TrainConfig)
    return resolve_config(TrainConfig, p.parse_args(argv), presets)


def test_precedence_defaults_preset_toml_flags(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('lr = 0.5\nbatch_size = 7\npreset = "p"\n')
    presets = {"p": TrainConfig(lr=0.2, batch_size=3, epochs=9)}
    cfg = parse(["--config", str(toml), "--batch-size", "11"], presets)
    assert (cfg.lr, cfg.batch_size, cfg.epochs) == (0.5, 11, 9)  # toml > preset, flag > toml
    assert parse([]).lr == TrainConfig().lr


def test_toml_wrong_type_names_file_and_field(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text('lr = "fast"\n')
    with pytest.raises(MarianaError, match=r"bad\.toml: field 'lr': expected float, got str"):
        parse(["--config", str(toml)])
    toml.write_text("nonsense_field = 1\n")
    with pytest.raises(MarianaError, match="unknown field 'nonsense_field'"):
        parse(["--config", str(toml)])


def test_config_roundtrip(tmp_path):
    cfg = dataclasses.replace(TrainConfig(), lr=3e-4, resume=True, out="x y", timeout=12.5)
    save_config(cfg, tmp_path / "config.toml")
    assert load_config(TrainConfig, tmp_path / "config.toml") == cfg


def test_validate_rejects_bad_values():
    with pytest.raises(MarianaError, match="--batch-size must be >= 1"):
        parse(["--batch-size", "0"])
    with pytest.raises(MarianaError, match="rdzv-endpoint"):
        parse(["--nnodes", "2"])


@pytest.mark.parametrize(
    "text,field,allowed",
    [
        ('optimizer = "rmsprop"\n', "optimizer", "sgd, adam, adamw"),
        ('amp = "fp8"\n', "amp", "auto, bf16, off"),
        ('schedule = "foo"\n', "schedule", "constant, cosine, linear"),
        ('grad_comm = "int8"\n', "grad_comm", "fp32, bf16, fp16"),
    ],
)
def test_toml_choices_are_enforced(tmp_path, text, field, allowed):
    toml = tmp_path / "job.toml"
    toml.write_text(text)
    bad = text.split('"')[1]
    with pytest.raises(MarianaError) as e:
        parse(["--config", str(toml)])
    assert str(e.value) == f"{toml}: field '{field}': expected one of {allowed}, got '{bad}'"


def test_preset_choices_and_numbers_are_validated():
    with pytest.raises(MarianaError, match="preset 'p': field 'optimizer': expected one of"):
        parse(["--preset", "p"], {"p": TrainConfig(optimizer="lion")})
    for flag, value in [("--lr", "-1"), ("--lr", "nan"), ("--weight-decay", "-0.1"), ("--clip-grad", "inf")]:
        with pytest.raises(MarianaError, match=f"{flag} must be a finite number >= 0"):
            parse([flag, value])
    assert parse(["--lr", "0"]).lr == 0.0  # lr 0 is allowed (a run that only measures)


def test_config_file_that_is_a_folder_or_binary(tmp_path):
    with pytest.raises(MarianaError, match="is a directory, expected a TOML file"):
        parse(["--config", str(tmp_path)])
    (tmp_path / "x.bin").write_bytes(b"\xff\xfe\x00\x81" * 64)
    with pytest.raises(MarianaError, match=r"x\.bin: not a UTF-8 TOML file"):
        parse(["--config", str(tmp_path / "x.bin")])


def test_path_fields_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = parse(["--data", "d/train.txt", "--out", "runs/a"])
    assert (cfg.data, cfg.out, cfg.config) == (str(tmp_path / "d/train.txt"), str(tmp_path / "runs/a"), "")


def test_resume_differences_use_the_allow_list(tmp_path):
    saved = TrainConfig(data=str(tmp_path / "d"), out=str(tmp_path / "r"), batch_size=32)
    save_config(saved, tmp_path / "config.toml")
    ok = dataclasses.replace(saved, epochs=5, max_steps=9, log_every=1, resume=True, progress=False)
    check_resume_config(ok, tmp_path)  # only fields that may change on resume
    bad = dataclasses.replace(ok, batch_size=64, seed=3, lr=0.1)
    assert [d[0] for d in resume_differences(bad, saved.__dict__)] == ["batch_size", "lr", "seed"]
    with pytest.raises(MarianaError, match=r"batch_size: 32 -> 64, lr: 0\.001 -> 0\.1, seed: 0 -> 3"):
        check_resume_config(bad, tmp_path)

    @dataclasses.dataclass
    class Wider(TrainConfig):
        RESUME_MAY_CHANGE = TrainConfig.RESUME_MAY_CHANGE | {"seed"}

    wider = Wider(**{f.name: getattr(bad, f.name) for f in dataclasses.fields(TrainConfig)})
    assert [d[0] for d in resume_differences(wider, saved.__dict__)] == ["batch_size", "lr"]


def test_atomic_write_leaves_no_temp(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "one")
    atomic_write_text(tmp_path / "a.txt", "two")
    atomic_torch_save({"w": torch.ones(2)}, tmp_path / "b.pt")
    assert (tmp_path / "a.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.pt"]
    assert torch.equal(torch.load(tmp_path / "b.pt", weights_only=True)["w"], torch.ones(2))


def test_export_roundtrip_without_pickle(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    export_model(tmp_path, model.state_dict(), app="t", arch="mlp", config={"hidden": 4})
    state, meta = load_exported(tmp_path)
    assert {k: meta[k] for k in ("app", "arch", "config", "metrics")} == {
        "app": "t",
        "arch": "mlp",
        "config": {"hidden": 4},
        "metrics": {},
    }
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    fresh.load_state_dict(state)
    x = torch.randn(5, 3)
    assert torch.equal(fresh(x), model(x))
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(MarianaError, match="not a readable safetensors"):
        load_exported(tmp_path)


def test_export_shared_and_strided_tensors_and_huge_page_tables(tmp_path):
    """Tensors that own their storage are written as is; views and aliases are de-aliased copies."""
    from mariana.platform.sparse.rules import table_empty

    table = table_empty((1 << 21, 17))  # 136 MB: large enough to be advised onto huge pages
    table.copy_(torch.arange(table.numel(), dtype=torch.float32).view_as(table))
    sd = {"table": table, "alias": table, "col": table[:5, 3], "rows": table[10:12]}
    export_model(tmp_path, sd, app="t", arch="t", config={})
    state, _ = load_exported(tmp_path)
    for k, v in sd.items():
        assert torch.equal(state[k], v), k
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.json", "model.safetensors"]


def test_sharded_sampler_matches_one_process_batches():
    one = ShardedBatchSampler(103, 8, 0, 1, seed=4)
    two = [ShardedBatchSampler(103, 4, r, 2, seed=4) for r in range(2)]
    for epoch in (0, 1):
        ref = list(one.batches(epoch))
        parts = [list(s.batches(epoch)) for s in two]
        assert len(ref) == len(parts[0]) == 12
        for b, batch in enumerate(ref):
            assert parts[0][b] + parts[1][b] == batch
    assert list(one.batches(1, start=5)) == list(one.batches(1))[5:]
    assert list(one.batches(0)) != list(one.batches(1))


def test_lr_schedule():
    assert lr_factor(0, 100, 10, "cosine") == pytest.approx(0.1)
    assert lr_factor(10, 100, 10, "cosine") == pytest.approx(1.0)
    assert lr_factor(100, 100, 10, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(55, 100, 10, "linear") == pytest.approx(0.5)


def test_parallel_dims_validate():
    assert ParallelDims(world_size=8, mp=2).dp == 4
    with pytest.raises(MarianaError, match="not divisible"):
        ParallelDims(world_size=6, mp=4)
