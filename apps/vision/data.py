"""Image data in the ImageFolder layout ``[split/]CLASS/NAME.jpg`` (classes sorted by name, so a tar and its
extracted copy give the same labels), read from a folder or from an uncompressed ``.tar`` indexed once and
read with ``os.pread`` (no extraction; forked DataLoader workers each open their own descriptor).

Two input paths: ``DecodedImages`` (every image decoded once into uint8 ``[N, 3, S, S]``, on the GPU when
available: no JPEG decoding per step) and ``StreamingImages`` (DataLoader workers read, and decode unless
``decode='cuda'``, per batch). Corrupt files are skipped and listed with their path, never a crash.
"""

from __future__ import annotations

import functools
import os
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from mariana.apps.vision.tarindex import scan_tar
from mariana.platform.core.errors import DataError

if TYPE_CHECKING:
    from .configs import VisionNet

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".JPG", ".JPEG", ".PNG")
# ImageNet channel statistics in 0..1 units; CIFAR's differ by < 0.03, not worth a second set.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
Prepare = Callable[[torch.Tensor], torch.Tensor]  # a uint8 batch on the device -> the model's float input


# ----------------------------------------------------------------------------------------------- sources
class ImageSource:
    """An indexed image collection: ``names[i]`` (path inside the source), ``labels[i]`` (int64 class id),
    ``classes`` (sorted class names); ``read(i) -> bytes`` reads the encoded file."""

    path: Path
    names: list[str]
    labels: torch.Tensor
    classes: list[str]

    def __len__(self) -> int:
        return len(self.names)

    def read(self, i: int) -> bytes:  # pragma: no cover - abstract
        raise NotImplementedError

    def _set_index(self, names: list[str], where: str, classes: Sequence[str] | None) -> None:
        if not names:
            raise DataError(
                f"{where}: no images found (expected the layout [split/]CLASS/NAME.jpg with extensions {IMAGE_EXTS})"
            )
        found = sorted({_class_of(n) for n in names})
        if classes is None:
            classes = found
        else:
            unknown = sorted(set(found) - set(classes))
            if unknown:
                raise DataError(
                    f"{where}: classes {unknown[:5]} are not among the model's classes {list(classes)[:10]}"
                )
        cid = {c: i for i, c in enumerate(classes)}
        order = sorted(range(len(names)), key=lambda i: names[i])  # deterministic order for both sources
        self.names = [names[i] for i in order]
        self.labels = torch.tensor([cid[_class_of(n)] for n in self.names], dtype=torch.int64)
        self.classes = list(classes)


def _class_of(name: str) -> str:
    parts = name.replace("\\", "/").split("/")
    if len(parts) < 2:
        raise DataError(f"{name}: image is not inside a class folder (expected [split/]CLASS/NAME.jpg)")
    return parts[-2]


class TarSource(ImageSource):
    """Images inside an uncompressed ``.tar``; members are read by offset (no extraction)."""

    def __init__(self, path: str | Path, classes: Sequence[str] | None = None):
        self.path = Path(path)
        self._offsets: list[tuple[int, int]] = []
        members = scan_tar(self.path)  # plain headers walked directly; anything else: tarfile
        if members is None:
            try:
                with tarfile.open(self.path, "r:") as tf:  # "r:" = no compression: offsets are file offsets
                    members = [(m.name, m.offset_data, m.size) for m in tf if m.isfile()]
            except tarfile.ReadError as e:
                raise DataError(f"{self.path}: not an uncompressed tar file ({e})") from None
        names, offsets = [], []
        for name, off, size in members:
            if name.endswith(IMAGE_EXTS) and "/" in name.strip("/"):
                names.append(name.lstrip("./"))
                offsets.append((off, size))
        pos = {n: o for n, o in zip(names, offsets)}
        self._set_index(names, str(self.path), classes)
        self._offsets = [pos[n] for n in self.names]
        self._fd: int | None = None
        self._pid = -1

    def read(self, i: int) -> bytes:
        if self._fd is None or self._pid != os.getpid():  # a forked DataLoader worker opens its own fd
            self._fd = os.open(self.path, os.O_RDONLY)
            self._pid = os.getpid()
        off, size = self._offsets[i]
        return os.pread(self._fd, size, off)

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_fd"], d["_pid"] = None, -1
        return d


class DirSource(ImageSource):
    """Images under a directory: ``DIR/[split/]CLASS/NAME.jpg``."""

    def __init__(self, path: str | Path, classes: Sequence[str] | None = None):
        self.path = Path(path)
        names = [
            p.relative_to(self.path).as_posix()
            for p in self.path.rglob("*")
            if p.suffix in IMAGE_EXTS and p.is_file() and p.parent != self.path
        ]
        self._set_index(names, str(self.path), classes)

    def read(self, i: int) -> bytes:
        return (self.path / self.names[i]).read_bytes()


def open_source(path: str | Path, classes: Sequence[str] | None = None) -> ImageSource:
    """A `TarSource` for a ``.tar`` file, a `DirSource` for a folder; DataError when neither exists."""
    p = Path(path)
    if not str(path):
        raise DataError("--data is required: a .tar shard or a folder in the layout [split/]CLASS/NAME.jpg")
    if p.is_dir():
        return DirSource(p, classes)
    if p.is_file():
        return TarSource(p, classes)
    raise DataError(f"{p}: no such file or folder (expected a .tar shard or an ImageFolder directory)")


# ----------------------------------------------------------------------------------------------- decoding
def _as_u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_one(data: bytes, size: int | None) -> torch.Tensor:
    """Encoded image bytes -> uint8 ``[3, S, S]`` (RGB; resized so the short side is S, centre-cropped).
    Raises ValueError when the bytes are not a decodable image."""
    from torchvision.io import ImageReadMode, decode_image

    if len(data) == 0:
        raise ValueError("empty file")
    try:
        img = decode_image(_as_u8(data), mode=ImageReadMode.RGB)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"not a decodable image ({str(e).splitlines()[0][:120]})") from None
    return fit_size(img, size)


def fit_size(img: torch.Tensor, size: int | None) -> torch.Tensor:
    """uint8 ``[3, H, W]`` -> ``[3, S, S]``: resize the short side to S (antialiased), centre crop."""
    if size is None or (img.shape[-1] == size and img.shape[-2] == size):
        return img
    from torchvision.transforms.v2 import functional as F

    img = F.resize(img, [size], antialias=True)
    return F.center_crop(img, [size, size])


def decode_many(
    blobs: list[bytes], size: int, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, list[int]]:
    """Decode a list of encoded images to uint8 ``[n_ok, 3, S, S]`` on ``device``; returns (images,
    indices of the blobs that failed). JPEGs are decoded in one batched ``decode_jpeg`` call (nvJPEG when
    ``device`` is CUDA); other formats and failures fall back to one-by-one CPU decoding."""
    from torchvision.io import ImageReadMode, decode_jpeg

    device = torch.device(device)
    out: list[torch.Tensor | None] = [None] * len(blobs)
    jpeg_idx = [i for i, b in enumerate(blobs) if b[:3] == b"\xff\xd8\xff"]
    if jpeg_idx:
        try:
            imgs = decode_jpeg([_as_u8(blobs[i]) for i in jpeg_idx], mode=ImageReadMode.RGB, device=device)
            for i, img in zip(jpeg_idx, imgs):
                out[i] = fit_size(img, size)
        except RuntimeError:
            pass  # one corrupt JPEG fails the whole batch: redo them one by one below
    bad = []
    for i, b in enumerate(blobs):
        if out[i] is None:
            try:
                out[i] = decode_one(b, size).to(device)
            except ValueError:
                bad.append(i)
    ok = [o for o in out if o is not None]
    if not ok:
        return torch.empty(0, 3, size, size, dtype=torch.uint8, device=device), bad
    return torch.stack(ok), bad


@dataclass
class DecodedImages:
    """A whole data set decoded once: ``images`` uint8 ``[N, 3, S, S]`` (CPU, or GPU when decoded there),
    ``labels`` int64 ``[N]``, ``classes``; ``bad`` lists ``(path, reason)`` of skipped files."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    bad: list[tuple[str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return self.images.shape[0]


def subset_indices(n: int, limit: int) -> list[int]:
    """Indices of the ``--limit`` subset of ``n`` images (all when ``limit`` is 0 or >= n): a fixed random
    choice in index order (names are sorted class by class: random keeps the class balance)."""
    if not limit or limit >= n:
        return list(range(n))
    g = torch.Generator().manual_seed(1234)
    return torch.randperm(n, generator=g)[:limit].sort().values.tolist()


def decode_all(
    src: ImageSource,
    size: int,
    device: str | torch.device = "cpu",
    limit: int = 0,
    chunk: int = 2048,
    progress: bool = False,
    workers: int = 0,
) -> DecodedImages:
    """Every image of ``src`` (its `subset_indices` ``limit`` subset) decoded into a `DecodedImages`; corrupt
    ones skipped and listed. ``workers`` > 0: chunks decoded on the CPU in that many DataLoader workers and
    copied to ``device`` as they arrive; 0: decoded in this process, batched on ``device`` (nvJPEG on CUDA)."""
    idx = subset_indices(len(src), limit)
    subs = [idx[s : s + chunk] for s in range(0, len(idx), chunk)]
    if workers > 0:  # several chunks per worker so the last ones finish together
        per = max(64, min(chunk, -(-len(idx) // (4 * workers))))
        subs = [idx[s : s + per] for s in range(0, len(idx), per)]
    decoded = _decode_chunks(src, subs, size, torch.device(device), workers)
    if progress:
        from tqdm import tqdm

        decoded = tqdm(decoded, total=len(subs), desc=f"decode {src.path.name}", unit="chunk", leave=False)
    parts, labels, bad = [], [], []
    for sub, (imgs, fails) in zip(subs, decoded):
        failed = set(fails)
        bad += [(f"{src.path}:{src.names[sub[j]]}", "not a decodable image") for j in fails]
        parts.append(imgs.to(device, non_blocking=True))
        labels.append(src.labels[[i for j, i in enumerate(sub) if j not in failed]])
    if not parts or sum(p.shape[0] for p in parts) == 0:
        raise DataError(f"{src.path}: none of the {len(idx)} images could be decoded")
    return DecodedImages(torch.cat(parts), torch.cat(labels), list(src.classes), bad)


class _ChunkDecoder(torch.utils.data.Dataset):
    """Item ``k`` -> ``decode_many`` of the images ``subs[k]`` of ``src`` on the CPU: (uint8 ``[n_ok,3,S,S]``,
    failed positions within the chunk)."""

    def __init__(self, src: ImageSource, subs: list[list[int]], size: int):
        self.src, self.subs, self.size = src, subs, size

    def __len__(self) -> int:
        return len(self.subs)

    def __getitem__(self, k: int):
        return decode_many([self.src.read(i) for i in self.subs[k]], self.size, "cpu")


def _decode_chunks(src: ImageSource, subs: list[list[int]], size: int, device: torch.device, workers: int):
    """Decoded chunks in order: ``(images, failed positions)`` per entry of ``subs``."""
    if workers <= 0:
        return (decode_many([src.read(i) for i in sub], size, device) for sub in subs)
    loader = torch.utils.data.DataLoader(
        _ChunkDecoder(src, subs, size),
        batch_size=None,  # an item is already a chunk
        num_workers=min(workers, len(subs)),
        pin_memory=device.type == "cuda",  # so the copy to the device can be asynchronous
        prefetch_factor=4,
    )
    return iter(loader)


# ------------------------------------------------------------------------------------ streaming dataset
class StreamingImages(torch.utils.data.Dataset):
    """Per-sample dataset for data too large to decode once: item ``i`` -> ``(uint8 [3,S,S] or None,
    label, path)``; with ``decode=False`` it returns the encoded bytes instead (GPU decoding later)."""

    def __init__(self, src: ImageSource, size: int, decode: bool = True):
        self.src, self.size, self.decode = src, size, decode

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int):
        data = self.src.read(i)
        label = int(self.src.labels[i])
        path = f"{self.src.path}:{self.src.names[i]}"
        if not self.decode:
            return data, label, path
        try:
            return decode_one(data, self.size), label, path
        except ValueError:
            return None, label, path


def collate_stream(items):
    """Collate `StreamingImages` items: (uint8 ``[B,3,S,S]`` or list of bytes, int64 ``[B]``, bad paths)."""
    ok = [(x, y) for x, y, _ in items if x is not None]
    bad = [p for x, _, p in items if x is None]
    labels = torch.tensor([y for _, y in ok], dtype=torch.int64)
    if ok and isinstance(ok[0][0], bytes):
        return [x for x, _ in ok], labels, bad
    imgs = torch.stack([x for x, _ in ok]) if ok else torch.empty(0, dtype=torch.uint8)
    return imgs, labels, bad


# ------------------------------------------------------------------------------------- GPU-side transforms
@functools.cache
def _norm_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`MEAN` and `STD` x 255 as ``[1,3,1,1]`` on ``device``, cached (no host copy per training step)."""
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
    return mean, std


def normalize(x: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
    """uint8 ``[B,3,S,S]`` -> float ``[B,3,S,S]`` normalised with `MEAN`/`STD` (on x's device)."""
    mean, std = _norm_constants(x.device)
    x = (x.float() - mean) / std
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def augment_batch(x: torch.Tensor, generator: torch.Generator | None = None, pad: int = 4) -> torch.Tensor:
    """uint8 ``[B,3,S,S]`` (any device) -> per-image random crop with ``pad`` px reflect padding and
    horizontal flip, as whole-batch tensor ops; deterministic given ``generator`` (a CPU generator)."""
    b, _, h, w = x.shape
    if pad:
        xp = torch.nn.functional.pad(x.float(), (pad, pad, pad, pad), mode="reflect")
        dy = torch.randint(0, 2 * pad + 1, (b,), generator=generator).to(x.device)
        dx = torch.randint(0, 2 * pad + 1, (b,), generator=generator).to(x.device)
        rows = (
            (dy.view(b, 1) + torch.arange(h, device=x.device).view(1, h))
            .view(b, 1, h, 1)
            .expand(b, 3, h, w + 2 * pad)
        )
        xp = xp.gather(2, rows)
        cols = (
            (dx.view(b, 1) + torch.arange(w, device=x.device).view(1, w)).view(b, 1, 1, w).expand(b, 3, h, w)
        )
        x = xp.gather(3, cols).to(x.dtype)
    flip = (torch.rand(b, generator=generator) < 0.5).to(x.device)
    return torch.where(flip.view(b, 1, 1, 1), x.flip(3), x)


def make_prepare(net: VisionNet, train: bool) -> Prepare:
    """-> ``prepare(x)``: uint8 batch ``[B,3,S,S]`` on the device -> float batch, augmented as ``net.augment``
    says (training only) and normalised (channels-last when ``net.channels_last``)."""

    def prepare(x: torch.Tensor) -> torch.Tensor:
        # alt-flip-translate runs in the loader (fast_recipe.DeviceEpochLoader): its flips depend on the epoch
        if train and net.augment not in ("none", "alt-flip-translate"):
            x = augment_batch(x, pad=net.image_size // 8 if net.augment == "flip-crop" else 0)
        return normalize(x, channels_last=net.channels_last)

    return prepare


# ------------------------------------------------------------------------------------------- prefetching
def gpu_decode_batch(size: int, device: torch.device):
    """A `Prefetcher` transform: ``(list of encoded images, labels, bad paths)`` -> ``(uint8 [B',3,S,S] on
    device, labels [B'], bad paths)``, decoding with batched ``decode_jpeg`` on ``device``; failures are
    dropped from the batch and added to the bad list."""

    def transform(batch):
        x, y, bad = batch
        if not isinstance(x, list):
            return batch
        imgs, fails = decode_many(x, size, device)
        if fails:
            keep = torch.ones(len(x), dtype=torch.bool)
            keep[fails] = False
            y = y[keep.to(y.device)]
            bad = list(bad) + [f"item {i} of a batch" for i in fails]
        return imgs, y, bad

    return transform


IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a")  # JPEG, PNG, GIF


def image_bytes_ok(data: bytes) -> bool:
    """Do the bytes start like an image torchvision decodes (JPEG, PNG, GIF)? A cheap upload check."""
    return any(data.startswith(m) for m in IMAGE_MAGIC)
