"""Vision input pipeline: tar shard == extracted folder, corrupt images skipped and counted, batch
augmentation, the classifier API and the train/eval/classify commands (run in this process by
`trained_runs.cli_here`: the files, output and exit codes of a subprocess, without an interpreter and a
torch import each)."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
import torch
from helpers import DATA, last_line
from mariana.apps.vision.data import (
    DirSource,
    StreamingImages,
    TarSource,
    augment_batch,
    collate_stream,
    decode_all,
    open_source,
)
from mariana.platform.core.errors import MarianaError
from trained_runs import cli_here

TEST_TAR = DATA / "cifar10" / "test-dev.tar"
CORRUPT = b"\xff\xd8\xff\xe0" + b"\x00garbage, not a jpeg" * 20


@pytest.fixture(scope="module")
def small_shard(tmp_path_factory):
    """A 60-image tar (6 per class, taken from test-dev.tar) plus one corrupt JPEG, and its extraction."""
    root = tmp_path_factory.mktemp("shard")
    shard = root / "small.tar"
    per_class: dict[str, int] = {}
    with tarfile.open(TEST_TAR) as src, tarfile.open(shard, "w") as dst:
        for m in src:
            if not m.isfile():
                continue
            cls = m.name.split("/")[-2]
            if per_class.get(cls, 0) < 6:
                per_class[cls] = per_class.get(cls, 0) + 1
                dst.addfile(m, src.extractfile(m))
        info = tarfile.TarInfo("test/cat/broken.jpg")
        info.size = len(CORRUPT)
        dst.addfile(info, io.BytesIO(CORRUPT))
    out = root / "extracted"
    with tarfile.open(shard) as tf:
        tf.extractall(out, filter="data")
    return shard, out


def test_tar_equals_extracted_folder(small_shard):
    shard, folder = small_shard
    t, d = TarSource(shard), DirSource(folder)
    assert len(t) == len(d) == 61
    assert t.classes == d.classes and len(t.classes) == 10
    assert t.names == d.names
    assert torch.equal(t.labels, d.labels)
    for i in range(len(t)):
        assert t.read(i) == d.read(i)
    a, b = decode_all(t, 32), decode_all(d, 32)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert isinstance(open_source(shard), TarSource) and isinstance(open_source(folder), DirSource)


def test_corrupt_jpeg_is_skipped_and_counted(small_shard):
    shard, folder = small_shard
    for src in (TarSource(shard), DirSource(folder)):
        data = decode_all(src, 32)
        assert len(data) == 60 and data.images.shape == (60, 3, 32, 32) and data.images.dtype == torch.uint8
        assert len(data.bad) == 1 and data.bad[0][0].endswith("test/cat/broken.jpg")
    # the streaming path (DataLoader workers) drops it from the batch and reports the path
    ds = StreamingImages(TarSource(shard), 32)
    loader = torch.utils.data.DataLoader(ds, batch_size=61, collate_fn=collate_stream, num_workers=1)
    imgs, labels, bad = next(iter(loader))
    assert imgs.shape == (60, 3, 32, 32) and labels.shape == (60,)
    assert len(bad) == 1 and bad[0].endswith("broken.jpg")


def test_bad_layout_and_missing_path_are_clear_errors(tmp_path):
    with pytest.raises(MarianaError, match="no such file"):
        open_source(tmp_path / "nope.tar")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MarianaError, match="no images found"):
        open_source(tmp_path / "empty")
    (tmp_path / "notatar.tar").write_bytes(b"hello")
    with pytest.raises(MarianaError, match="not an uncompressed tar"):
        open_source(tmp_path / "notatar.tar")


def test_augment_batch_crops_and_flips_whole_batch():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).view(2, 3, 8, 8).to(torch.uint8)
    g = torch.Generator().manual_seed(0)
    y = augment_batch(x, generator=g, pad=0)
    for i in range(2):  # pad=0: each image is itself or its mirror
        assert torch.equal(y[i], x[i]) or torch.equal(y[i], x[i].flip(2))
    z = augment_batch(x, generator=torch.Generator().manual_seed(1), pad=2)
    assert z.shape == x.shape and z.dtype == torch.uint8


@pytest.mark.slow
def test_train_eval_classify_commands(small_shard, tmp_path):
    shard, folder = small_shard
    run = tmp_path / "run"
    proc = cli_here(
        [
            "vision",
            "train",
            "--data",
            shard,
            "--eval-data",
            folder,
            "--out",
            run,
            "--preset",
            "debug",
            "--batch-size",
            "8",
            "--max-steps",
            "3",
            "--no-progress",
        ],
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert last_line(proc.stdout).startswith("top-1 ")
    assert json.loads((run / "metrics.json").read_text())["skipped_images"] == 1
    assert "broken.jpg" in (run / "skipped.json").read_text()

    proc = cli_here(["vision", "eval", "--model", run, "--data", shard])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert last_line(proc.stdout).startswith("top-1 ") and "top-5 " in last_line(proc.stdout)
    from mariana.platform.core.rundir import eval_result_path

    assert f"result written to {eval_result_path(run, shard)}" in proc.stdout
    ev = json.loads(eval_result_path(run, shard).read_text())
    assert ev["images"] == 60 and ev["skipped"] == 1 and 0 <= ev["top1"] <= ev["top5"] <= 100
    assert ev["tta"] is False
    proc = cli_here(["vision", "eval", "--model", run, "--data", shard, "--tta"])
    assert proc.returncode == 0 and last_line(proc.stdout).endswith("(flip TTA)"), proc.stderr[-4000:]
    tta_ev = json.loads(eval_result_path(run, shard).read_text())
    assert tta_ev["tta"] is True and tta_ev["images"] == 60 and 0 <= tta_ev["top1"] <= tta_ev["top5"] <= 100

    img = next(p for p in folder.rglob("*.jpg") if p.name != "broken.jpg")
    proc = cli_here(["vision", "classify", "--model", run, img, folder / "test" / "cat" / "broken.jpg"])
    # the good file is classified, the broken one reported; a partial failure exits non-zero
    assert proc.returncode == 2, proc.stderr[-4000:]
    (first,) = proc.stdout.strip().splitlines()
    assert len(first.split(": ", 1)[1].split(", ")) == 5
    assert "broken.jpg" in proc.stderr and "classified 1 of 2 image(s)" in proc.stderr
    assert "Traceback" not in proc.stderr

    from mariana.apps.vision.predict import load_classifier

    clf = load_classifier(run)
    top = clf.classify_bytes(img.read_bytes(), k=3)
    assert len(top) == 3 and all(lbl in clf.classes for lbl, _ in top)

    # The same labels over HTTP from a real `mariana serve --vision`; a corrupt upload is a 4xx.
    from test_serving_helpers import Server

    srv = Server(["--vision", run, "--threads", "1"], tmp_path)
    try:
        resp = srv.client.post(
            "/v1/vision/classify?k=3", files={"file": ("a.jpg", img.read_bytes(), "image/jpeg")}
        )
        assert resp.status_code == 200, resp.text
        assert [x["label"] for x in resp.json()["labels"]] == [lbl for lbl, _ in top]
        assert resp.json()["tta"] is False  # off unless asked for
        flip = clf.classify_bytes(img.read_bytes(), k=3, tta=True)
        resp = srv.client.post(
            "/v1/vision/classify?k=3&tta=true", files={"file": ("a.jpg", img.read_bytes(), "image/jpeg")}
        )
        assert resp.status_code == 200 and resp.json()["tta"] is True, resp.text
        got = [(x["label"], x["probability"]) for x in resp.json()["labels"]]
        assert [lbl for lbl, _ in got] == [lbl for lbl, _ in flip]
        assert [p for _, p in got] == pytest.approx([p for _, p in flip], abs=1e-6)
        broken = (folder / "test" / "cat" / "broken.jpg").read_bytes()
        bad = srv.client.post("/v1/vision/classify", files={"file": ("b.jpg", broken, "image/jpeg")})
        assert 400 <= bad.status_code < 500, bad.text
    finally:
        srv.stop()
    assert top[0][1] >= top[1][1] >= top[2][1] and sum(p for _, p in top) <= 1.0 + 1e-6
    for junk in (b"", b"hello world", CORRUPT, b"\x89PNG\r\n\x1a\n" + b"\x00" * 40):
        with pytest.raises((ValueError, MarianaError), match="image"):
            clf.classify_bytes(junk)
    # the serving layer reports this as the model version: stable for the same weights, str, non-empty
    assert clf.version == json.loads((run / "model.json").read_text())["version"]  # the weights' digest
    assert load_classifier(run).version == clf.version


def test_raw_bytes_path_decodes_like_the_worker_path(small_shard):
    """The GPU input path (workers read bytes, the prefetch thread decodes batched) run on CPU gives the
    same batch as decoding in the workers, and still drops + reports the corrupt image."""
    from mariana.apps.vision.data import gpu_decode_batch
    from mariana.platform.core.prefetch import Prefetcher

    shard, _ = small_shard
    src = TarSource(shard)
    cpu = torch.device("cpu")

    def batches(decode: bool):
        ds = StreamingImages(src, 32, decode=decode)
        loader = torch.utils.data.DataLoader(ds, batch_size=61, collate_fn=collate_stream)
        return list(
            Prefetcher(iter(loader), device=cpu, transform=None if decode else gpu_decode_batch(32, cpu))
        )

    (a,), (b,) = batches(True), batches(False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert len(a[2]) == len(b[2]) == 1


@pytest.mark.slow
def test_streamed_training_skips_and_counts_corrupt_image_once(small_shard, tmp_path):
    """--cache off: DataLoader workers read from the tar and decode per step; the corrupt JPEG is
    dropped from its batch in every epoch but recorded once."""
    shard, _ = small_shard
    run = tmp_path / "run"
    args = ["vision", "train", "--data", shard, "--out", run, "--preset", "debug", "--cache", "off"]
    # one batch of all 61 files per epoch, 2 epochs: the corrupt file is met twice
    args += ["--num-workers", "1", "--batch-size", "61", "--max-steps", "2", "--no-progress"]
    proc = cli_here(args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert last_line(proc.stdout).startswith("train loss")
    assert "(streamed)" in proc.stderr
    assert json.loads((run / "metrics.json").read_text())["skipped_images"] == 1
    skipped = json.loads((run / "skipped.json").read_text())["skipped"]
    assert [s["path"].endswith("test/cat/broken.jpg") for s in skipped] == [True]


def test_model_too_deep_for_image_size_is_a_clear_error(small_shard, tmp_path):
    shard, _ = small_shard
    args = [
        "vision",
        "train",
        "--data",
        shard,
        "--out",
        tmp_path / "r",
        "--model",
        "alexnet",
        "--max-steps",
        "1",
    ]
    proc = cli_here(args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--model alexnet cannot take 32 px images" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_flip_tta_is_the_mean_of_the_image_and_mirror_predictions():
    from mariana.apps.vision.predict import Classifier

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4))  # not mirror-symmetric
    clf = Classifier(model, list("abcd"), 8, [0.5] * 3, [0.25] * 3, torch.device("cpu"))
    images = torch.randint(0, 256, (5, 3, 8, 8), dtype=torch.uint8)
    plain, mirrored = clf.probabilities(images), clf.probabilities(images.flip(-1))
    assert not torch.allclose(plain, mirrored, atol=1e-3)  # so the check below can fail
    torch.testing.assert_close(clf.probabilities(images, tta=True), (plain + mirrored) / 2)
