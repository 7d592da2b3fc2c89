"""Inference API (used by ``mariana vision classify`` and the serving layer).

clf = load_classifier("runs/vision")          # RUN/model.safetensors + its metadata; no pickle
clf.classify_bytes(jpeg_bytes, k=5)           # -> [("cat", 0.83), ("dog", 0.09), ...]
clf.version                                   # "3f2a9c1e7b4d05aa": the exported weights' digest
clf.onnx_graph(2, gen) / clf.use_onnx(fn)     # the network as `mariana export --format onnx` writes it / run it
"""

from __future__ import annotations

from pathlib import Path

import torch
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.export import load_exported

from .data import decode_one, image_bytes_ok
from .fast_recipe import tta_mode, tta_probabilities
from .model import build_model


class Classifier:
    """An exported vision model ready for inference on ``device``: ``classes``, ``image_size``,
    ``version`` (the exported weights' digest, `mariana.platform.core.export.weights_digest`: the same
    weights always report the same version)."""

    def __init__(
        self,
        model: torch.nn.Module,
        classes: list[str],
        image_size: int,
        mean,
        std,
        device: torch.device,
        version: str = "unknown",
    ):
        self.model, self.classes, self.device = model.eval(), list(classes), device
        self.image_size, self.version = image_size, version
        self.mean = torch.tensor(mean, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(std, device=device).view(1, 3, 1, 1) * 255

    @torch.no_grad()
    def probabilities(self, images: torch.Tensor, tta: bool | str = False) -> torch.Tensor:
        """uint8 ``[B,3,S,S]`` -> class probabilities float ``[B, C]``; ``tta`` (True = ``"flip"``: 2x the
        compute, ``"crops"``: 6x): the mean over the views of `fast_recipe.tta_views`."""
        x = (images.to(self.device).float() - self.mean) / self.std
        return tta_probabilities(self.model, x, tta_mode(tta))

    def onnx_graph(self, batch: int, gen: torch.Generator) -> tuple:
        """What `mariana export --format onnx` writes: (the network alone: normalised images float32
        ``[B,3,S,S]`` -> logits ``[B, classes]``, example images of ``batch`` drawn with ``gen``, the output's
        name, the dynamic axes). Decoding, normalisation, TTA and softmax stay here."""
        x = torch.randn(batch, 3, self.image_size, self.image_size, generator=gen)
        return self.model, {"images": x}, "logits", {"images": {0: "batch"}}

    def use_onnx(self, run) -> None:
        """Classify through ``run(images) -> logits`` (the `onnx_graph` network in a runtime)."""
        self.model = run

    def classify_bytes(self, data: bytes, k: int = 5, tta: bool | str = False) -> list[tuple[str, float]]:
        """Encoded image (JPEG/PNG/GIF bytes) -> the top-``k`` (label, probability), best first
        (``tta``: see `probabilities`). Raises MarianaError when the bytes are not a decodable image."""
        if not isinstance(data, bytes | bytearray) or not image_bytes_ok(bytes(data[:8])):
            raise MarianaError("input is not an image (expected JPEG, PNG or GIF bytes)")
        try:
            img = decode_one(bytes(data), self.image_size)
        except ValueError as e:
            raise MarianaError(f"input image cannot be decoded: {e}") from None
        p = self.probabilities(img.unsqueeze(0), tta)[0]
        top = p.topk(min(k, len(self.classes)))
        return [(self.classes[i], float(v)) for v, i in zip(top.values.tolist(), top.indices.tolist())]

    def classify_file(self, path: str | Path, k: int = 5, tta: bool | str = False) -> list[tuple[str, float]]:
        p = Path(path)
        if not p.is_file():
            raise MarianaError(f"{p}: no such image file")
        try:
            return self.classify_bytes(p.read_bytes(), k, tta)
        except MarianaError as e:
            raise MarianaError(f"{p}: {e}") from None


def load_classifier(run_dir: str | Path, device: str | torch.device = "cpu") -> Classifier:
    """Load ``RUN/model.safetensors`` (weights) + metadata (model name, classes, image size,
    normalisation) written by ``mariana vision train``."""
    device = torch.device(device)
    state, meta = load_exported(run_dir, app="vision")
    arch = meta.get("arch") or meta["model"]
    model = build_model(arch, len(meta["classes"]), int(meta["image_size"]), float(meta.get("dropout", 0.5)))
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise MarianaError(f"{run_dir}: weights do not match model {arch!r}: {str(e)[:300]}") from None
    return Classifier(
        model.to(device),
        meta["classes"],
        int(meta["image_size"]),
        meta["mean"],
        meta["std"],
        device,
        meta["version"],
    )
