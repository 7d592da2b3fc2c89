"""`mariana pctr train --image-features`: a click log whose field C3 names a creative image; a real (tiny)
`mariana vision train` CNN gives the features. Train -> export -> `mariana pctr eval` and a real
`mariana serve --pctr` answer the same probabilities; a corrupt and a missing image are skipped and counted
(the file named); a second training run reuses the feature cache instead of recomputing it."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from mariana.apps.pctr.data.encoding import ReadStats, iter_chunks
from mariana.apps.pctr.models.predict import load_predictor
from mariana.platform.core.export import load_exported
from mariana.platform.core.rundir import eval_result_path
from test_serving_helpers import pctr_probs, serve, strip_label
from torchvision.io import encode_png
from trained_runs import cli_here, train

N_ADS, ROWS, DIMS = 12, 2000, 4
BAD = {"ad12": "corrupt", "ad13": "missing"}  # ad12.png is not a PNG; ad13 has no file


def _png(color: int, g: torch.Generator) -> bytes:
    img = (torch.rand(3, 32, 32, generator=g) * 80).to(torch.uint8)
    img[2 * color] += 150  # red or blue creatives
    return encode_png(img).numpy().tobytes()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny CNN trained on red/blue images, 12 creatives + a corrupt one, a click log where segment s0
    clicks red ads and s1 blue ones, and one image-feature training run (DeepFM)."""
    root = tmp_path_factory.mktemp("pctr-images")
    g = torch.Generator().manual_seed(0)
    for c, name in enumerate(["red", "blue"]):
        (root / "vdata" / name).mkdir(parents=True)
        for i in range(8):
            (root / "vdata" / name / f"{i}.png").write_bytes(_png(c, g))
    # both runs made in this process (`trained_runs.train`: no interpreter start-up each); the tests read them
    vrun = train(
        ["vision", "train", "--data", root / "vdata", "--preset", "debug", "--no-progress"], root / "vision"
    )
    ads = root / "ads"
    ads.mkdir()
    for i in range(N_ADS):
        (ads / f"ad{i}.png").write_bytes(_png(i % 2, g))
    (ads / "ad12.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    rnd = random.Random(0)
    lines = []
    for _ in range(ROWS):
        a, seg = rnd.randrange(N_ADS + 2), rnd.randrange(2)
        y = int(rnd.random() < (0.8 if a % 2 == seg else 0.15))
        cats = [f"u{rnd.randrange(40)}", f"s{seg}", f"ad{a}"] + [""] * 23
        lines.append("\t".join([str(y)] + [""] * 13 + cats))
    data = root / "clicks.tsv"
    data.write_text("\n".join(lines) + "\n")
    common = ["--format", "criteo", "--data", data, "--preset", "debug", "--image-features", vrun.path]
    common += ["--image-field", "C3", "--images", ads, "--image-cache", root / "cache"]
    common += ["--image-dims", DIMS, "--max-steps", 40]
    # the DeepFM also crosses the features with the segment (C2): extra fields served the same way
    deepfm = train(["pctr", "train", *common, "--model", "deepfm", "--image-cross", "C2"], root / "deepfm")
    return {"root": root, "data": data, "lines": lines, "run": deepfm.path, "common": common, "train": deepfm}


def _bad_rows(lines: list[str], lo: int, hi: int) -> int:
    return sum(1 for ln in lines[lo:hi] if ln.split("\t")[16] in BAD)


def test_train_skips_and_counts_bad_images(world):
    m = json.loads((world["run"] / "metrics.json").read_text())
    # training (0..1600) and validation (1600..1800) rows naming ad12 / ad13 are skipped, not fatal
    assert m["skipped_lines"] == _bad_rows(world["lines"], 0, 1800) > 0
    msgs = list(m["skipped_examples"].values())
    assert any("ad12.png" in s and "not a decodable image" in s for s in msgs), msgs
    assert any("no image file" in s and "ad13" in s for s in msgs), msgs
    assert "skipped" in world["train"].stderr and "ad1" in world["train"].stderr
    assert m["image_features"]["computed"] == N_ADS  # once per distinct usable image
    state, meta = load_exported(world["run"])
    assert meta["schema"]["num_dense"] == 13 + DIMS and meta["image"]["field"] == "C3"
    assert meta["schema"]["num_fields"] == 39 + DIMS and meta["image"]["cross"] == "C2"
    assert (
        tuple(state["image.proj"].shape) == (state["image.mean"].shape[0], DIMS) == (128, DIMS)
    )  # cifar-fast: 8 x 16 channels
    assert any(k.startswith("image.cnn.") for k in state)


def test_eval_and_serving_match_offline(world, tmp_path_factory):
    run, data, lines = world["run"], world["data"], world["lines"]
    proc = cli_here(["pctr", "eval", "--model", run, "--data", data], check=True)
    assert proc.stdout.strip().splitlines()[-1].startswith("AUC ")
    result = json.loads(eval_result_path(run, data).read_text())
    assert result["skipped"] == _bad_rows(lines, 0, ROWS)
    pred = load_predictor(run)
    stats = ReadStats()
    offline = np.concatenate([pred.predict(c) for c in iter_chunks(data, pred.encoder, stats=stats)])
    assert stats.skipped == result["skipped"] and len(offline) == result["rows"]

    srv = serve(["--pctr", run], tmp_path_factory)
    try:
        req = [strip_label(ln, "criteo") for ln in lines[:300]]
        body = srv.predict(req).json()
        good = [i for i, ln in enumerate(lines[:300]) if ln.split("\t")[16] not in BAD]
        served = [body["probabilities"][i] for i in good]
        np.testing.assert_allclose(served, offline[: len(good)], rtol=0, atol=1e-5)
        errs = {e["index"]: e["error"] for e in body["errors"]}
        assert set(errs) == set(range(300)) - set(good)
        assert all("ad12.png" in errs[i] or "ad13" in errs[i] for i in errs)
        # structured instances name the creative the same way; a path outside the folder is refused
        i0 = good[0]
        c = lines[i0].split("\t")
        inst = {"C1": c[14], "C2": c[15], "C3": c[16]}
        assert pctr_probs(srv.predict([inst])) == pytest.approx([served[0]], abs=1e-5)
        out = srv.predict([inst, {**inst, "C3": "../ads/ad1.png"}]).json()
        assert out["probabilities"][1] is None and "inside the images folder" in out["errors"][0]["error"]
    finally:
        srv.stop()


def test_lr_uses_image_features_and_cache_is_reused(world):
    cache = world["root"] / "cache"
    before = sorted(p.name for p in cache.rglob("seg-*.safetensors"))
    assert before
    run = world["root"] / "lr"
    cli_here(["pctr", "train", *world["common"], "--model", "lr", "--out", run], check=True)
    m = json.loads((run / "metrics.json").read_text())
    assert m["image_features"]["computed"] == 0 and m["image_features"]["hits"] >= N_ADS
    assert sorted(p.name for p in cache.rglob("seg-*.safetensors")) == before  # nothing recomputed
    state, _ = load_exported(run)
    w = state["dense_linear.weight"]  # LR's weights of the 13 counts + the image features
    assert tuple(w.shape) == (1, 13 + DIMS) and w[0, 13:].abs().sum() > 0
    assert load_exported(run)[1]["schema"]["num_fields"] == 39  # no --image-cross here


def test_flag_errors_name_the_flag(world):
    from mariana.apps.pctr.configs import PctrConfig
    from mariana.apps.pctr.images.features import field_position
    from mariana.platform.cli.main import check_command
    from mariana.platform.core.errors import MarianaError

    with pytest.raises(MarianaError, match="--image-field"):
        PctrConfig(data="x", out="y", image_features=str(world["root"] / "vision")).validate()
    with pytest.raises(MarianaError, match="--image-field applies to runs with --image-features only"):
        check_command(["pctr", "train", "--data", "x", "--image-field", "C3"])
    with pytest.raises(MarianaError, match="C1..C26"):
        field_position("criteo", "C30")
    assert field_position("criteo", "C3") == 15 and field_position("libfm", "3") == 2
    proc = cli_here(
        ["pctr", "train", *world["common"], "--images", world["root"] / "nope", "--out", world["root"] / "x"]
    )
    assert proc.returncode == 2 and "--images" in proc.stderr and "no such folder" in proc.stderr
