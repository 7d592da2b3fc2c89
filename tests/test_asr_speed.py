"""ASR training at device speed: one loader for the whole run, resident batches equal the disk tier's,
bucketed frames compile once (no recompiles after the first epoch)."""

from __future__ import annotations

import argparse
import dataclasses

import torch
from mariana.apps.asr import train as asr_train
from mariana.apps.asr.batches import ResidentBatches, bucket_frames, collate_bucketed, make_loader
from mariana.apps.asr.configs import PRESETS, AsrConfig
from mariana.apps.asr.features import UtteranceSet, cached_features, feature_settings
from mariana.platform.core import loop
from mariana.platform.core.config import add_config_args, resolve_config
from mariana.platform.data.shards import choose_tier
from mariana.platform.dp import sampler as sampler_mod
from test_app_registry import _asr_data


def _cfg(data, out, **kw):
    return dataclasses.replace(
        PRESETS["debug"], data=str(data), out=str(out), progress=False, speed_perturb=[1.0], **kw
    )


def test_disk_tier_builds_one_loader_over_three_epochs(tmp_path, monkeypatch):
    built = []

    class CountingLoader(torch.utils.data.DataLoader):
        def __init__(self, *a, **kw):
            built.append(kw.get("persistent_workers"))
            super().__init__(*a, **kw)

    monkeypatch.setattr(sampler_mod, "DataLoader", CountingLoader)
    cfg = _cfg(_asr_data(tmp_path), tmp_path / "run", epochs=3, cache_gb=0.0, num_workers=1)
    final = asr_train.train(cfg)
    assert final["epochs_completed"] == 3
    assert built == [True]  # one DataLoader, its worker process kept over the epochs


def test_resident_batches_equal_the_disk_tiers(tmp_path):
    data = _asr_data(tmp_path)
    cfg = _cfg(data, tmp_path / "run")
    cache = cached_features(data / "train", feature_settings(cfg), 1)
    ds = UtteranceSet(cache, ["<blank>"] + sorted({w for u in cache.utts for w in u["words"]}))
    sampler = asr_train.BucketBatchSampler(ds.lengths, 4)
    cpu = torch.device("cpu")
    resident, tier = make_loader(cfg, ds, sampler, cpu)
    assert tier == "device" and isinstance(resident, ResidentBatches)
    disk, tier = make_loader(dataclasses.replace(cfg, cache_gb=0.0), ds, sampler, cpu)
    assert tier == "disk"
    for a, b in zip(resident.iterate(1), disk.iterate(1), strict=True):
        assert a["feats"].shape[1] == bucket_frames(int(a["lengths"].max()))
        for k in ("feats", "lengths", "targets", "target_lengths"):
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
        assert a["sizes"].lengths.tolist() == b["sizes"].lengths.tolist()
    one = collate_bucketed([ds[0]])
    assert (
        one["feats"].shape[1] == bucket_frames(ds.lengths[0])
        and (one["feats"][0, ds.lengths[0] :] == 0).all()
    )


def test_tiers_device_then_host_ram_then_disk():
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert choose_tier(10**9, gpu, 0.0, free_device=8 * 10**9) == "device"
    assert choose_tier(3 * 10**9, gpu, 4.0, free_device=8 * 10**9) == "host"
    assert choose_tier(5 * 10**9, gpu, 4.0, free_device=8 * 10**9) == "disk"
    assert choose_tier(3 * 10**9, cpu, 4.0) == "device" and choose_tier(5 * 10**9, cpu, 4.0) == "disk"


def test_bucket_lengths_are_few():
    assert len({bucket_frames(t) for t in range(1, 1001)}) == 15  # 32, 48, ..., 1200
    assert all(bucket_frames(t) >= t for t in range(1, 3000))


def test_compiled_default_recipe_recompiles_nothing_after_the_first_epoch(tmp_path, monkeypatch):
    # The default recipe's network and augmentation (SpecAugment, LayerNorm, dropout) with time stretch on
    # top, compiled with aot_eager: every graph is made in the first epoch, the next two add none.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    seen = []
    real_write = loop.MetricsLogger.write

    def write(self, record):
        if "loss" in record:
            seen.append((record["epoch"], counters["stats"]["unique_graphs"]))
        real_write(self, record)

    monkeypatch.setattr(loop.MetricsLogger, "write", write)
    monkeypatch.setenv("MARIANA_COMPILE_CACHE", str(tmp_path / "compile-cache"))
    small = PRESETS["small"]
    cfg = dataclasses.replace(
        small,
        data=str(_asr_data(tmp_path)),
        out=str(tmp_path / "run"),
        progress=False,
        speed_perturb=[0.9, 1.0, 1.1],
        time_stretch=[0.8, 1.25],
        hidden=32,
        context=5,
        epochs=3,
        batch_size=8,
        log_every=1,
        beam=0,
        compile=True,
        compile_backend="aot_eager",
    )
    final = asr_train.train(cfg)
    assert final["epochs_completed"] == 3
    first_epoch = max(g for e, g in seen if e == 0)
    assert first_epoch >= 1 and seen[-1][1] == first_epoch, seen
    torch._dynamo.reset()


def test_compile_is_on_by_default_on_a_gpu_only():
    # The small recipe's eager step is launch-bound on a GPU (bench/asr_throughput.py), so training compiles
    # there unless --no-compile; on the CPU it stays eager unless --compile.
    parser = argparse.ArgumentParser()
    add_config_args(parser, AsrConfig)
    default, off = (resolve_config(AsrConfig, parser.parse_args(a), PRESETS) for a in ([], ["--no-compile"]))
    assert default.compile is None and off.compile is False
    assert asr_train.compiles(default, "cuda") and not asr_train.compiles(default, "cpu")
    assert not asr_train.compiles(off, "cuda")
    assert asr_train.compiles(dataclasses.replace(default, compile=True), "cpu")
    net = torch.nn.Linear(2, 2)
    assert asr_train.compile_model(net, default) is net  # a CPU model: eager
    on = dataclasses.replace(default, compile=True, compile_backend="aot_eager")
    assert isinstance(asr_train.compile_model(net, on), torch._dynamo.eval_frame.OptimizedModule)
