"""The ``fast`` preset: whitening init against its definition, multi-crop TTA = mean of the views'
probabilities (same answer from the API, `vision eval`, `vision classify` and REST), the recipe's step
reads nothing from the device, and the preset trains in one process and with 2 workers."""

from __future__ import annotations

import json
import tarfile

import pytest
import torch
import torch.nn.functional as F
from helpers import DATA, last_line, run_cli
from mariana.apps.vision.fast_recipe import fastnet, init_whitening, patches, whitening_weights
from mariana.apps.vision.predict import Classifier
from trained_runs import cli_here

TEST_TAR = DATA / "cifar10" / "test-dev.tar"


def smooth_images(n: int = 16, size: int = 12) -> torch.Tensor:
    """Correlated (blurred, channel-mixed) float images, so the patch covariance is far from identity."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, size, size, generator=g)
    x = F.avg_pool2d(F.pad(x, (1, 1, 1, 1), mode="circular"), 3, stride=1)
    return x + 0.5 * x.mean(1, keepdim=True)


def test_whitened_patches_have_identity_covariance_up_to_eps():
    x = smooth_images()
    p = patches(x)
    cov = p.T.double() @ p.double() / len(p)
    assert (cov - torch.eye(12, dtype=torch.float64)).abs().max() > 0.1  # so the check below can fail
    eps = 5e-4
    net = fastnet()
    init_whitening(net, x, eps)
    w = net.whiten.weight.double()
    torch.testing.assert_close(w[12:], -w[:12])  # the negated copies
    out = F.conv2d(x.double(), w[:12])  # the whitening layer without its bias, first 12 channels
    flat = out.permute(0, 2, 3, 1).reshape(-1, 12)
    got = flat.T @ flat / len(flat)
    eig = torch.linalg.eigvalsh(cov).flip(0)
    # the definition: W C W^T = diag(lambda / (lambda + eps)), i.e. the identity up to eps / lambda
    torch.testing.assert_close(got, torch.diag(eig / (eig + eps)), atol=1e-6, rtol=1e-6)
    assert (got - torch.eye(12, dtype=torch.float64)).abs().max() <= (eps / (eig.min() + eps)).item() + 1e-9
    # a layer not initialised from the data does not whiten (the check discriminates)
    plain = F.conv2d(x.double(), fastnet().whiten.weight.double()[:12])
    flat = plain.permute(0, 2, 3, 1).reshape(-1, 12)
    assert ((flat.T @ flat / len(flat)) - torch.eye(12, dtype=torch.float64)).abs().max() > 0.1
    assert whitening_weights(x, eps=eps).shape == (24, 3, 2, 2)


def crops_by_hand(x: torch.Tensor) -> list[torch.Tensor]:
    """The 6 crops views written out pixel by pixel: the image, shifted by one pixel down-right and up-left
    (reflect padding), each with its mirror image."""
    b, c, h, w = x.shape
    xp = F.pad(x, (1, 1, 1, 1), mode="reflect")
    views = []
    for dy, dx in ((1, 1), (0, 0), (2, 2)):
        v = torch.stack([torch.stack([xp[:, :, i + dy, j + dx] for j in range(w)], -1) for i in range(h)], -2)
        views += [v, v.flip(-1)]
    return views


def test_crops_tta_is_the_mean_of_the_views_probabilities():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4))  # not shift-invariant
    clf = Classifier(model, list("abcd"), 8, [0.5] * 3, [0.25] * 3, torch.device("cpu"))
    images = torch.randint(0, 256, (5, 3, 8, 8), dtype=torch.uint8)
    x = (images.float() - 0.5 * 255) / (0.25 * 255)
    with torch.no_grad():
        by_hand = torch.stack([torch.softmax(model(v), 1) for v in crops_by_hand(x)]).mean(0)
    got = clf.probabilities(images, tta="crops")
    torch.testing.assert_close(got, by_hand)
    assert not torch.allclose(got, clf.probabilities(images, tta="flip"), atol=1e-3)  # more than the flip


@pytest.fixture(scope="module")
def small_tar(tmp_path_factory):
    """A 100-image tar (10 per class) from test-dev.tar."""
    shard = tmp_path_factory.mktemp("fast") / "small.tar"
    per_class: dict[str, int] = {}
    with tarfile.open(TEST_TAR) as src, tarfile.open(shard, "w") as dst:
        for m in src:
            cls = m.name.split("/")[-2] if m.isfile() else None
            if cls and per_class.get(cls, 0) < 10:
                per_class[cls] = per_class.get(cls, 0) + 1
                dst.addfile(m, src.extractfile(m))
    return shard


def train_fast(shard, out, *extra):
    args = ["vision", "train", "--preset", "fast", "--data", shard, "--out", out, "--device", "cpu"]
    args += ["--batch-size", "16", "--max-steps", "3", "--lr", "0.02", "--no-progress", *extra]
    # several workers: torchrun's agent and its processes (not in this process); one: in this process
    proc = run_cli(args, timeout=240) if "--workers" in extra else cli_here(args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.slow
def test_fast_preset_trains_and_crops_tta_agrees_across_cli_and_rest(small_tar, tmp_path):
    from mariana.apps.vision.data import decode_all, open_source
    from mariana.apps.vision.predict import load_classifier
    from mariana.platform.core.evaluator import topk_correct
    from mariana.platform.core.rundir import eval_result_path

    run = tmp_path / "run"
    final = train_fast(small_tar, run, "--eval-data", small_tar)
    assert final["steps"] == 3 and final["eval_images"] == 100
    clf = load_classifier(run)

    # vision eval --tta-mode crops = the API's crops probabilities on the decoded images
    proc = cli_here(["vision", "eval", "--model", run, "--data", small_tar, "--tta-mode", "crops"])
    assert proc.returncode == 0 and last_line(proc.stdout).endswith("(crops TTA)"), proc.stderr[-4000:]
    ev = json.loads(eval_result_path(run, small_tar).read_text())
    data = decode_all(open_source(small_tar, clf.classes), clf.image_size)
    c1, _ = topk_correct(clf.probabilities(data.images, tta="crops"), data.labels)
    assert ev["tta_mode"] == "crops" and ev["top1"] == pytest.approx(100.0 * c1 / 100)

    with tarfile.open(small_tar) as tf:
        m = next(m for m in tf if m.isfile())
        img = tf.extractfile(m).read()
    (tmp_path / "a.jpg").write_bytes(img)
    want = clf.classify_bytes(img, k=3, tta="crops")
    assert want != clf.classify_bytes(img, k=3, tta="flip")
    proc = cli_here(
        ["vision", "classify", "--model", run, tmp_path / "a.jpg", "-k", "3", "--tta-mode", "crops"]
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = [s.rsplit(" ", 1) for s in proc.stdout.strip().split(": ", 1)[1].split(", ")]
    assert [(lbl, round(p, 3)) for lbl, p in want] == [(lbl, float(p)) for lbl, p in printed]

    from test_serving_helpers import Server

    srv = Server(["--vision", run, "--threads", "1"], tmp_path)
    try:
        resp = srv.client.post(
            "/v1/vision/classify?k=3&tta=crops", files={"file": ("a.jpg", img, "image/jpeg")}
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["tta_mode"] == "crops" and resp.json()["tta"] is True
        got = [(x["label"], x["probability"]) for x in resp.json()["labels"]]
        assert [lbl for lbl, _ in got] == [lbl for lbl, _ in want]
        assert [p for _, p in got] == pytest.approx([p for _, p in want], abs=1e-6)
        bad = srv.client.post(
            "/v1/vision/classify?tta=sideways", files={"file": ("a.jpg", img, "image/jpeg")}
        )
        assert bad.status_code == 422, bad.text
    finally:
        srv.stop()


@pytest.mark.slow
def test_fast_preset_trains_with_two_workers(small_tar, tmp_path):
    final = train_fast(small_tar, tmp_path / "dp", "--workers", "2", "--batch-size", "8")
    assert final["world_size"] == 2 and final["steps"] == 3
    assert final["train_loss"] == final["train_loss"]  # finite, not NaN


def test_fast_preset_refuses_the_pipeline():
    from mariana.apps.vision.configs import PRESETS
    from mariana.platform.core.errors import MarianaError

    cfg = PRESETS["fast"]
    import dataclasses

    bad = dataclasses.replace(cfg, workers=2, model_parallel=2)
    with pytest.raises(MarianaError, match="data parallel only"):
        bad.validate()


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the tensor calls that copy a value to the host (a device sync on a GPU)."""

    READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def test_fast_recipe_steps_read_nothing_from_the_device():
    """Six steps of the recipe (loader augmentation, forward/backward, Nesterov SGD, a Lookahead update)
    call none of .item/.tolist/.cpu/bool/int on a tensor; a planted .item() is caught."""
    import dataclasses
    from types import SimpleNamespace

    from mariana.apps.vision.configs import PRESETS
    from mariana.apps.vision.data import DecodedImages, normalize
    from mariana.apps.vision.fast_recipe import DeviceEpochLoader, FastStep

    cfg = dataclasses.replace(PRESETS["fast"], batch_size=8, epochs=2, amp="off", device="cpu")
    cpu = torch.device("cpu")
    ctx = SimpleNamespace(device=cpu, world_size=1, distributed=False, set_phase=lambda _: None)
    data = DecodedImages(torch.randint(0, 256, (32, 3, 32, 32), dtype=torch.uint8), torch.arange(32) % 10, [])
    net = fastnet()
    init_whitening(net, normalize(data.images))

    def loss(m, batch):
        x, y = batch
        return F.cross_entropy(m(normalize(x)), y, label_smoothing=0.2), len(y)

    step = FastStep(cfg, net, loss, ctx)
    step.setup(total_steps=8)
    loader = DeviceEpochLoader(data, 8, 0, 1, seed=0)
    batches = iter(loader.iterate(0))
    normalize(data.images[:1])  # the normalisation constants are built once, before the steps
    with HostReads() as reads:
        for _ in range(6):
            step.train_step([next(batches) if _ < 4 else next(iter(loader.iterate(1)))])
    assert reads.calls == []
    with HostReads() as reads:
        torch.ones(1).item()  # the planted fault
    assert reads.calls == ["item"]


def test_fast_recipe_resumes_exactly():
    """6 steps (one Lookahead update), checkpoint state, a fresh step object restored from it, 2 more steps
    (mid-epoch, ending with the final Lookahead copy) == 8 uninterrupted steps, bit for bit; without the
    Lookahead state it differs."""
    import copy
    import dataclasses
    from types import SimpleNamespace

    from mariana.apps.vision.configs import PRESETS
    from mariana.apps.vision.data import DecodedImages, normalize
    from mariana.apps.vision.fast_recipe import DeviceEpochLoader, FastStep

    cfg = dataclasses.replace(PRESETS["fast"], batch_size=8, epochs=2, amp="off", device="cpu")
    ctx = SimpleNamespace(
        device=torch.device("cpu"), world_size=1, distributed=False, set_phase=lambda _: None
    )
    data = DecodedImages(torch.randint(0, 256, (32, 3, 32, 32), dtype=torch.uint8), torch.arange(32) % 10, [])
    loader = DeviceEpochLoader(data, 8, 0, 1, seed=3)

    def loss(m, batch):
        x, y = batch
        return F.cross_entropy(m(normalize(x)), y, label_smoothing=0.2), len(y)

    def fresh():
        torch.manual_seed(0)
        net = fastnet()
        init_whitening(net, normalize(data.images))
        step = FastStep(cfg, net, loss, ctx)
        step.setup(total_steps=8)
        return step

    def run(step, start, stop):
        for t in range(start, stop):
            epoch, pos = divmod(t, loader.batches_per_epoch)
            step.train_step([next(iter(loader.iterate(epoch, pos)))])

    ref = fresh()
    run(ref, 0, 8)
    first = fresh()
    run(first, 0, 6)
    saved = copy.deepcopy(first.checkpoint_state(None))
    for keep_lookahead in (True, False):
        second = fresh()
        state = copy.deepcopy(saved)  # restoring aliases the optimizer's buffers: a fresh copy each time
        if keep_lookahead:
            second.restore(state, None)
        else:
            second.restore({**state, "lookahead": [t.clone() for t in second.lookahead.ema]}, None)
        run(second, 6, 8)
        same = all(
            torch.equal(a, b)
            for a, b in zip(ref.model.state_dict().values(), second.model.state_dict().values())
        )
        assert same is keep_lookahead
