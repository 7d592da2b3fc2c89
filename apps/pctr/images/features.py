"""Image features for click models: a field of the click log names the ad's creative image, and a trained
`mariana vision train` CNN turns the image into a dense input of the click model (LR and the deep models).

In: the field's values (resolved under ``--images DIR``); out: ``k = --image-dims`` floats per record
(the CNN's penultimate activations [D], projected by a whitened PCA fitted on the training split's
images; k = D when 0) appended to ``Batch.dense``. The field, bad images, the on-disk cache (append-only
safetensors segments, safe under concurrent runs) and the export are described in apps/pctr/README.md,
Image features: a served model computes the same features as training without the vision run.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
import zlib
from dataclasses import fields, replace
from pathlib import Path

import torch
from mariana.apps.vision.data import decode_one
from mariana.apps.vision.model import build_model
from mariana.apps.vision.predict import load_classifier
from mariana.platform.core.atomic import atomic_write_path
from mariana.platform.core.errors import DataError, MarianaError
from mariana.platform.core.export import load_exported

from ..configs import Images
from ..data.sources import resolve_sources

log = logging.getLogger("mariana")

IMAGE_EXTS = (".png", ".jpg", ".jpeg")
CNN_PREFIX = "image.cnn."
BATCH = 256  # images per CNN forward pass
MEM_LIMIT = 200_000  # features kept in memory without a disk cache (serving) before starting over


def default_cache_dir() -> Path:
    """``$MARIANA_CACHE/pctr-image-features``, else ``~/.cache/mariana/pctr-image-features``."""
    root = os.environ.get("MARIANA_CACHE") or (Path.home() / ".cache" / "mariana")
    return Path(root) / "pctr-image-features"


def field_position(fmt: str, field: str) -> int:
    """0-based position of the image field in an UNLABELLED record: criteo ``C3`` -> 13 + 2 (tab-separated
    columns); libfm ``3`` -> 2 (whitespace-separated ``id:value`` pairs). MarianaError if it is not one."""
    f = str(field).strip()
    if fmt == "criteo":
        if f[:1] in ("C", "c") and f[1:].isdigit() and 1 <= int(f[1:]) <= 26:
            return 13 + int(f[1:]) - 1
        raise MarianaError(f"--image-field {field!r}: criteo image fields are categorical columns C1..C26")
    if f.isdigit() and int(f) >= 1:
        return int(f) - 1
    raise MarianaError(f"--image-field {field!r}: for libfm give the 1-based field number (e.g. 3)")


def field_values(lines: list[str], idx: list[int], fmt: str, pos: int, has_label: bool) -> list[str]:
    """The image field's raw value of ``lines[i]`` for each ``i`` in ``idx`` ("" where absent)."""
    out = []
    if fmt == "criteo":
        k = pos + has_label
        for i in idx:
            parts = lines[i].rstrip("\r\n").split("\t")
            out.append(parts[k] if k < len(parts) else "")
    else:
        k = pos + has_label
        for i in idx:
            parts = lines[i].split()
            out.append(parts[k].split(":", 1)[0] if k < len(parts) else "")
    return out


def resolve(root: Path, value: str) -> Path | str:
    """The image file ``value`` names under ``root`` (see the module doc), or an error message."""
    if not value:
        return "no image named (the image field is empty)"
    rel = Path(value)
    if rel.is_absolute() or ".." in rel.parts:
        return f"image name {value[:80]!r} must be a path inside the images folder {root}"
    if rel.suffix.lower() in IMAGE_EXTS:
        cands = [root / rel]
    else:
        cands = [root / (value + e) for e in IMAGE_EXTS]
    for c in cands:
        if c.is_file():
            return c
    return f"no image file {cands[0] if len(cands) == 1 else root / (value + '.{png,jpg,jpeg}')}"


def penultimate_layer(model: torch.nn.Module) -> torch.nn.Linear:
    """The CNN's last ``nn.Linear`` (its input is the feature vector)."""
    lin = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not lin:
        raise MarianaError("the vision model has no Linear classifier layer to take features from")
    return lin[-1]


class ImageFeatures:
    """CNN features of the images a click-log field names, projected to ``dims`` floats.

    ``model``: the vision CNN (eval mode); ``image_size``, ``mean``/``std`` (0..1 scale, 3 values): its
    evaluation preprocessing; ``version``: its exported weights' digest (keys the cache). ``proj_mean``
    float32 [D] and ``proj`` float32 [D, k] (None until fitted; identity with ``dims`` 0)."""

    def __init__(
        self,
        model: torch.nn.Module,
        meta: dict,
        fmt: str,
        field: str,
        images: str | Path,
        cache: str | Path | None = None,
        cross: str = "",
    ):
        self.model = model.eval()
        self.cnn_meta = {k: meta[k] for k in ("arch", "classes", "image_size", "mean", "std", "version")}
        self.cnn_meta["dropout"] = float(meta.get("dropout", 0.5))
        self.image_size = int(meta["image_size"])
        self.version = str(meta["version"])
        self.mean = torch.tensor(meta["mean"], dtype=torch.float32).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(meta["std"], dtype=torch.float32).view(1, 3, 1, 1) * 255
        self.fmt, self.field, self.pos = fmt, str(field), field_position(fmt, field)
        self.root = Path(images).resolve()
        self.cross = str(cross or "")
        self.cross_pos = field_position(fmt, self.cross) if self.cross else -1
        self._F, self._R = 0, 0  # parsed fields and rows per field of the encoder (`attach`)
        self.cache_root = str(Path(cache).resolve()) if cache else ""
        self.cache = Path(cache) / self.version if cache else None
        self.proj_mean: torch.Tensor | None = None
        self.proj: torch.Tensor | None = None
        self._mem: dict[tuple[str, int, int], torch.Tensor] = {}  # (path, size, mtime_ns) -> [D]
        self._bad: dict[tuple[str, int, int], str] = {}  # files that failed to decode -> why (not re-read)
        self._disk_loaded = False
        self._lock = threading.Lock()
        # hits: lookups answered from memory or the disk cache; computed: images run through the CNN;
        # failed: image files that could not be read or decoded
        self.counts = {"hits": 0, "computed": 0, "failed": 0}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_vision_run(
        cls, run: str | Path, fmt: str, field: str, images, cache=None, cross: str = ""
    ) -> ImageFeatures:
        """The CNN of a `mariana vision train` run (its exported ``model.safetensors``)."""
        clf = load_classifier(run)
        _, meta = load_exported(run)
        meta = {**meta, "arch": meta.get("arch") or meta.get("model")}
        return cls(clf.model.float(), meta, fmt, field, images, cache, cross)

    @classmethod
    def from_export(
        cls, state: dict[str, torch.Tensor], info: dict, fmt: str, images=None, cache=None
    ) -> ImageFeatures:
        """Rebuild from a pCTR export: pops ``image.*`` from ``state``; ``images`` overrides the folder
        recorded at training."""
        cnn = info["cnn"]
        model = build_model(cnn["arch"], len(cnn["classes"]), int(cnn["image_size"]), float(cnn["dropout"]))
        sd = {k[len(CNN_PREFIX) :]: state.pop(k) for k in [k for k in state if k.startswith(CNN_PREFIX)]}
        try:
            model.load_state_dict(sd)
        except RuntimeError as e:
            raise MarianaError(
                f"the exported image CNN does not match its metadata: {str(e)[:300]}"
            ) from None
        f = cls(model, cnn, fmt, info["field"], images or info["images"], cache, info.get("cross", ""))
        f.proj_mean, f.proj = state.pop("image.mean").float(), state.pop("image.proj").float()
        return f

    @property
    def dims(self) -> int:
        return 0 if self.proj is None else int(self.proj.shape[1])

    @property
    def cross_fields(self) -> int:
        """Fields `--image-cross` appends (one per feature dimension), 0 without it."""
        return self.dims if self.cross else 0

    def attach(self, encoder) -> None:
        """Make ``encoder`` append the features (its ``schema.num_fields`` already counts the cross fields)."""
        if self.cross and getattr(encoder.schema, "ids", "hash") != "hash":
            raise MarianaError("--image-cross needs hashed ids (not --ids dynamic)")
        encoder.parsed_fields = encoder.schema.num_fields - self.cross_fields
        self._F, self._R = encoder.parsed_fields, encoder.schema.rows_per_field
        encoder.image = self

    def meta(self) -> dict:
        return {
            "field": self.field,
            "images": str(self.root),
            "dims": self.dims,
            "cache": self.cache_root,
            "cross": self.cross,
            "cnn": self.cnn_meta,
        }

    def use_cache(self, root: str | Path | None) -> None:
        """Read and add to the feature cache under ``root`` from now on (None: memory only)."""
        with self._lock:
            self.cache_root = str(Path(root).resolve()) if root else ""
            self.cache = Path(root) / self.version if root else None
            self._disk_loaded = False

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors the export carries (CNN weights, projection)."""
        sd = {CNN_PREFIX + k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        sd["image.mean"], sd["image.proj"] = self.proj_mean, self.proj
        return sd

    # ------------------------------------------------------------------ projection
    def fit(self, values: list[str], dims: int) -> dict:
        """Features of the distinct images ``values`` names, then the projection (PCA to ``dims`` whitened
        components, 0 = raw features) fitted on those that decode. Returns {images, failed, dims}."""
        distinct = sorted(set(values))
        feats, errors = self.features(distinct, progress=True)
        ok = [feats[v] for v in distinct if v in feats]
        if not ok:
            first = next(iter(errors.items()), ("", "no value"))
            raise DataError(
                f"--image-field {self.field}: none of the {len(distinct)} training images could be used "
                f"(first: {first[0]!r}: {first[1]})"
            )
        x = torch.stack(ok).double()
        mean = x.mean(0)
        D = x.shape[1]
        if dims <= 0:
            self.proj_mean, self.proj = mean.float(), torch.eye(D)
        else:
            k = min(dims, D, max(1, len(ok) - 1))
            if k < dims:
                log.warning("--image-dims %d: only %d components from %d training images", dims, k, len(ok))
            _, s, vh = torch.linalg.svd(x - mean, full_matrices=False)
            comp = vh[:k].T  # [D, k]
            # a fixed sign per component (largest loading positive): the same images, the same projection
            comp = comp * torch.sign(comp.gather(0, comp.abs().argmax(0, keepdim=True)))
            sd = (s[:k] / max(1.0, len(ok) - 1) ** 0.5).clamp_min(1e-6)
            self.proj_mean, self.proj = mean.float(), (comp / sd).float()
        return {"images": len(distinct), "failed": len(errors), "dims": self.dims}

    # ------------------------------------------------------------------ features
    def features(self, values: list[str], progress: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
        """Raw CNN features [D] of each distinct value that names a usable image, and value -> error."""
        found: dict[str, torch.Tensor] = {}
        errors: dict[str, str] = {}
        todo: list[tuple[str, tuple[str, int, int], Path]] = []
        with self._lock:
            self._load_disk()
            for v in dict.fromkeys(values):
                p = resolve(self.root, v)
                if isinstance(p, str):
                    errors[v] = p
                    continue
                try:
                    st = p.stat()
                except OSError as e:
                    errors[v] = f"image {p}: {e.strerror or e}"
                    continue
                key = (str(p), st.st_size, st.st_mtime_ns)
                if key in self._mem:
                    found[v] = self._mem[key]
                    self.counts["hits"] += 1
                elif key in self._bad:
                    errors[v] = self._bad[key]
                else:
                    todo.append((v, key, p))
            if todo and self.cache is None and len(self._mem) + len(todo) > MEM_LIMIT:
                self._mem.clear()  # a long-running server meeting ever new creatives stays bounded
            if todo:
                computed, bad = self._compute([(k, p) for _, k, p in todo], progress)
                for v, key, _p in todo:
                    if key in computed:
                        found[v] = computed[key]
                    else:
                        errors[v] = bad[key]
        return found, errors

    def _compute(self, items: list[tuple[tuple, Path]], progress: bool):
        """Decode + CNN forward of ``items`` [(key, path)] in batches; new features go to memory and to
        one cache segment per batch. Returns ({key: [D]}, {key: error})."""
        out: dict[tuple, torch.Tensor] = {}
        bad: dict[tuple, str] = {}
        grabbed: list[torch.Tensor] = []
        hook = penultimate_layer(self.model).register_forward_pre_hook(
            lambda _m, a: grabbed.append(a[0].detach().flatten(1))
        )
        t0 = time.monotonic()
        try:
            for b in range(0, len(items), BATCH):
                imgs, keys = [], []
                for key, p in items[b : b + BATCH]:
                    try:
                        imgs.append(decode_one(p.read_bytes(), self.image_size))
                        keys.append(key)
                    except (OSError, ValueError) as e:
                        bad[key] = self._bad[key] = f"image {p}: {e}"
                if not imgs:
                    continue
                grabbed.clear()
                with torch.inference_mode():
                    self.model((torch.stack(imgs).float() - self.mean) / self.std)
                feats = grabbed[0].float().clone()
                for key, f in zip(keys, feats):
                    out[key] = self._mem[key] = f
                self._save_segment(keys, feats)
                if progress and len(items) > BATCH:
                    done = min(b + BATCH, len(items))
                    log.info("image features: %d/%d images (%.0f s)", done, len(items), time.monotonic() - t0)
        finally:
            hook.remove()
        self.counts["computed"] += len(out)
        self.counts["failed"] += len(bad)
        return out, bad

    def _load_disk(self) -> None:
        if self._disk_loaded or self.cache is None:
            self._disk_loaded = True
            return
        from safetensors import safe_open

        self._disk_loaded = True
        if not self.cache.is_dir():
            return
        n = 0
        for seg in sorted(self.cache.glob("seg-*.safetensors")):
            try:
                with safe_open(str(seg), framework="pt") as f:
                    keys = json.loads(f.metadata()["keys"])
                    feats = f.get_tensor("features")
            except Exception as e:  # noqa: BLE001  -- a damaged segment is recomputed, never fatal
                log.warning("image feature cache: ignoring %s (%s)", seg, e)
                continue
            for (path, size, mtime), row in zip(keys, feats):
                self._mem[(path, int(size), int(mtime))] = row
                n += 1
        if n:
            log.info("image feature cache: %d entries from %s", n, self.cache)

    def _save_segment(self, keys: list[tuple], feats: torch.Tensor) -> None:
        if self.cache is None:
            return
        from safetensors.torch import save_file

        try:
            self.cache.mkdir(parents=True, exist_ok=True)
            name = self.cache / f"seg-{time.time_ns()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.safetensors"
            meta = {"keys": json.dumps([list(k) for k in keys])}
            atomic_write_path(
                name, lambda tmp: save_file({"features": feats.contiguous()}, tmp, metadata=meta)
            )
        except OSError as e:  # a read-only cache costs recomputation next time, not the run
            log.warning("image feature cache: cannot write to %s (%s)", self.cache, e)
            self.cache = None

    def project(self, feats: torch.Tensor) -> torch.Tensor:
        """Raw features [n, D] -> model inputs [n, k]."""
        return (feats - self.proj_mean) @ self.proj

    # ------------------------------------------------------------------ batches
    def apply(self, out: tuple, lines: list[str], has_label: bool) -> tuple:
        """An encoder result ``(Batch, good indices into lines, errors)`` -> the same with the projected
        image features appended to ``Batch.dense`` and the rows whose image fails moved to ``errors``."""
        batch, good, errors = out
        values = field_values(lines, good, self.fmt, self.pos, has_label)
        found, bad = self.features(values)
        keep = [j for j, v in enumerate(values) if v in found]
        k = self.dims
        img = self.project(torch.stack([found[values[j]] for j in keep])) if keep else torch.zeros(0, k)
        if len(keep) < len(values):
            errors = dict(errors)
            for j, v in enumerate(values):
                if v not in found:
                    errors[good[j]] = f"field {self.field}: {bad[v]}"
            errors = dict(sorted(errors.items()))
            idx = torch.tensor(keep, dtype=torch.long)
            batch = replace(
                batch,
                **{
                    f.name: getattr(batch, f.name)[idx]
                    for f in fields(batch)
                    if isinstance(getattr(batch, f.name), torch.Tensor)
                },
            )
            good = [good[j] for j in keep]
        img = img.to(batch.dense.dtype)
        batch = replace(batch, dense=torch.cat([batch.dense, img], 1))
        if self.cross:
            batch = self._crossed(batch, img, field_values(lines, good, self.fmt, self.cross_pos, has_label))
        return batch, good, errors

    def _crossed(self, batch, img: torch.Tensor, values: list[str]):
        """`--image-cross`: feature j becomes the value of field ``F + j`` whose row is the crossed
        field's value (hashed; missing -> the field's row 0), so the model's linear term holds one weight
        vector per crossed value: LR learns how each segment (say) likes each image direction."""
        R = self._R
        local = torch.tensor(
            [1 + zlib.crc32(v.encode()) % (R - 1) if v else 0 for v in values], dtype=torch.long
        )
        base = (self._F + torch.arange(img.shape[1], dtype=torch.long)) * R
        ids = local[:, None] + base[None, :]
        return replace(batch, ids=torch.cat([batch.ids, ids], 1), vals=torch.cat([batch.vals, img], 1))


def scan_values(path, fmt: str, field: str, start: int, stop: int) -> list[str]:
    """The image field's distinct values on lines ``[start, stop)`` (0-based) of a labelled data source
    (a file, a comma-separated list of files or a folder of partitions, `data/sources.py`)."""
    pos = field_position(fmt, field)
    src = resolve_sources(path)
    pieces = [(0, src.paths[0], start, stop)] if src.single else src.ranges(start, stop)
    vals = set()
    for _, p, lo, hi in pieces:
        with open(p, encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f):
                if i >= hi:
                    break
                if i >= lo:
                    vals.update(field_values([line], [0], fmt, pos, True))
    return sorted(vals)


def setup_image_features(image: Images, init_from: str, source) -> ImageFeatures:
    """``--image-features`` (the ``image`` section): the CNN, its features of the training split's images
    (cached) and the projection (fitted here, or taken from the export of ``init_from``, the run's
    ``--init-from``, so the dense weights keep their meaning); appends the projected dimensions to the
    schema's ``num_dense`` and attaches to the encoder of ``source`` (the run's `data.reader.ClickSource`)."""
    schema, encoder = source.schema, source.encoder
    cache = image.image_cache or default_cache_dir()
    if not Path(image.images).is_dir():
        raise DataError(f"--images {image.images}: no such folder")
    feats = ImageFeatures.from_vision_run(
        image.image_features, schema.format, image.image_field, image.images, cache, image.image_cross
    )
    prev = _init_projection(init_from)
    if prev is not None:
        if prev["version"] != feats.version:
            raise MarianaError(
                f"--init-from {init_from} used image CNN version {prev['version']}, "
                f"--image-features {image.image_features} is version {feats.version}; use the same vision run"
            )
        feats.proj_mean, feats.proj = prev["mean"], prev["proj"]
        info = {"dims": feats.dims, "from": init_from}
    else:
        values = scan_values(source.sources, schema.format, image.image_field, *source.bounds["train"])
        log.info("image features: %d distinct images in the training split", len(values))
        info = feats.fit(values, image.image_dims)
    log.info(
        "image features: %s; %d from the cache, %d computed, %d unusable",
        info,
        feats.counts["hits"],
        feats.counts["computed"],
        feats.counts["failed"],
    )
    schema.num_dense += feats.dims
    schema.num_fields += feats.cross_fields
    feats.attach(encoder)
    return feats


def _init_projection(init_from: str) -> dict | None:
    """The CNN version and projection of the run ``init_from`` (None without ``--init-from``)."""
    if not init_from:
        return None
    state, meta = load_exported(init_from)
    if "image" not in meta:
        raise MarianaError(f"--init-from {init_from} was trained without --image-features")
    return {
        "version": meta["image"]["cnn"]["version"],
        "mean": state["image.mean"],
        "proj": state["image.proj"],
    }
