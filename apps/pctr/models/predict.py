"""Inference API used by `mariana pctr eval` and the serving module (apps/pctr/README.md, "Serving API").

``load_predictor(run_dir) -> Predictor`` reads only the exported files (``model.safetensors`` with the
metadata JSON); nothing is unpickled, the weights are memory-mapped and the table adopted, never copied.
``.parse(lines)`` / ``.parse_json(instances)`` -> (Batch, errors by index: invalid records are left out);
criteo JSON ``{"I1": 3, ..., "C26": "a9b0..."}`` (absent key = missing), libfm ``{"features": [[id, value],
...]}`` or ``{"features": {"id": value}}``. ``.predict(batch)`` -> float32 [B] click probabilities;
``.predict_lines(lines)`` -> (probs, None where invalid; errors). Unseen ids (and, with ``--ids dynamic``,
ids holding no row of the exported map) are scored with the field's OOV row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.export import load_exported
from torch import nn

from ..data.encoding import CRITEO_CATS, CRITEO_INTS, Batch, Encoder, Schema
from ..ids.idmap import FrozenIdMap
from ..images.features import ImageFeatures
from .nets import CTRModel


class Predictor:
    def __init__(
        self,
        state: dict[str, torch.Tensor],
        meta: dict,
        device: str | torch.device = "cpu",
        images: str | Path | None = None,
        image_cache: str | Path | None = None,
    ):
        """``images``: folder the image field resolves in (default: the one recorded at training);
        ``image_cache``: feature cache folder (default: none, features are kept in memory)."""
        self.meta = meta
        if "table.weight" not in state or "seen" not in state:
            raise MarianaError("the exported pctr model lacks its embedding table ('table.weight', 'seen')")
        self.schema = Schema.from_dict(meta["schema"])
        self.format: str = self.schema.format
        self.version: str = str(meta.get("version", "unknown"))
        self.encoder = Encoder(self.schema)
        self.image = None  # `--image-features` models: the CNN + projection travel in the export
        if "image" in meta:
            self.image = ImageFeatures.from_export(state, meta["image"], self.format, images, image_cache)
            self.image.attach(self.encoder)
        m = meta["model"]
        hidden = tuple(int(h) for h in str(m["hidden"]).split(",") if h.strip())
        self.device = torch.device(device)
        self.model = CTRModel(
            m["kind"],
            self.schema.num_rows,
            self.schema.num_fields,
            self.schema.num_dense,
            m["dim"],
            hidden,
            m["cross_layers"],
            float(m.get("dropout", 0.0)),  # identity in eval mode, but it numbers the MLP's layers
            table=state.pop("table.weight"),  # adopted as is: no second full-size table
        )
        self.seen = state.pop("seen").bool().to(self.device)
        self.idmap = None  # `--ids dynamic` models: the exported key of each row (never-seen ids -> OOV)
        row_key = state.pop("idmap.row_key", None)
        if self.schema.ids == "dynamic":
            if row_key is None:
                raise MarianaError(
                    "the exported pctr model was trained with --ids dynamic but lacks 'idmap.row_key'"
                )
            if tuple(row_key.shape) != (self.schema.num_rows,):
                raise MarianaError(
                    f"the exported id map has shape {tuple(row_key.shape)}, expected ({self.schema.num_rows},)"
                )
            self.idmap = FrozenIdMap(row_key.numpy(), self.schema.num_fields, self.schema.rows_per_field)
        try:
            self.model.load_dense_state_dict(state)
        except ValueError as e:
            raise MarianaError(f"the exported model does not match its metadata: {e}") from None
        self.model.to(self.device).eval()
        self.R = self.schema.rows_per_field
        self.onnx = None  # `use_onnx`: rows, values, dense -> probabilities, instead of the torch model

    def parse(self, lines: list[str]) -> tuple[Batch, dict[int, str]]:
        batch, _, errors = self.encoder.encode(list(lines), has_label=False)
        return batch, errors

    def parse_json(self, instances: list[dict]) -> tuple[Batch, dict[int, str]]:
        lines, bad, index = [], {}, []
        for i, inst in enumerate(instances):
            try:
                lines.append(self._json_line(inst))
                index.append(i)
            except (TypeError, ValueError, KeyError) as e:
                bad[i] = f"invalid instance: {e}"
        batch, errors = self.parse(lines)
        for j, msg in errors.items():
            bad[index[j]] = msg
        return batch, dict(sorted(bad.items()))

    def _json_line(self, inst: dict) -> str:
        if not isinstance(inst, dict):
            raise TypeError(f"expected an object, got {type(inst).__name__}")
        if self.format == "criteo":
            names = [f"I{i}" for i in range(1, CRITEO_INTS + 1)] + [
                f"C{i}" for i in range(1, CRITEO_CATS + 1)
            ]
            unknown = set(inst) - set(names)
            if unknown:
                raise KeyError(f"unknown field(s) {sorted(unknown)}")
            for n in names[:CRITEO_INTS]:
                v = inst.get(n)
                if v is not None and (isinstance(v, bool) or not isinstance(v, int | str)):
                    raise ValueError(f"{n} must be an integer")
            return "\t".join("" if inst.get(n) is None else str(inst[n]) for n in names)
        feats = inst.get("features")
        if isinstance(feats, dict):
            feats = list(feats.items())
        if not isinstance(feats, list):
            raise KeyError("libfm instances need 'features': [[id, value], ...] or {id: value}")
        return " ".join(f"{int(k)}:{float(v)}" for k, v in feats)

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        if len(batch) == 0:
            return np.zeros(0, dtype=np.float32)
        b = batch.to(self.device)
        ids = b.ids
        if self.idmap is not None:  # keys -> rows of the exported map
            ids = torch.from_numpy(self.idmap.lookup(ids.cpu().numpy())).to(self.device)
        if self.onnx is not None:
            return self.onnx(ids, b.vals, b.dense).numpy()
        ids = torch.where(self.seen[ids], ids, ids - ids % self.R)  # never trained -> the field's OOV row
        uniq, inv = torch.unique(ids, return_inverse=True)
        rows = self.model.table.weight.index_select(0, uniq)
        logits = self.model.forward_rows(F.embedding(inv, rows), b.vals, b.dense)
        return torch.sigmoid(logits).float().cpu().numpy()

    def onnx_graph(self, batch: int, gen: torch.Generator) -> tuple:
        """What `mariana export --format onnx` writes: (`ClickScorer`, example inputs of ``batch`` records
        drawn with ``gen`` (rows of every field, trained or not), the output's name, the dynamic axes)."""
        f, d = self.schema.num_fields, self.schema.num_dense
        ids = torch.randint(0, self.schema.num_rows, (batch, f), generator=gen)
        inputs = {
            "ids": ids,
            "vals": torch.rand(batch, f, generator=gen),
            "dense": torch.rand(batch, d, generator=gen),
        }
        return ClickScorer(self), inputs, "probs", {k: {0: "batch"} for k in inputs}

    def use_onnx(self, run) -> None:
        """Score through ``run(ids, vals, dense) -> probabilities`` (`ClickScorer`'s graph in a runtime)."""
        self.onnx = run

    def predict_lines(self, lines: list[str]) -> tuple[list[float | None], dict[int, str]]:
        batch, errors = self.parse(lines)
        probs = iter(self.predict(batch).tolist())
        return [None if i in errors else next(probs) for i in range(len(lines))], errors


class ClickScorer(nn.Module):
    """A predictor's model as one graph (the ONNX export): ``ids`` int64 [B, F] the encoder's rows (with
    ``--ids dynamic``, rows the exported id map gave the keys), ``vals`` float32 [B, F], ``dense`` float32
    [B, D] -> click probabilities float32 [B]. Rows never trained are mapped to their field's OOV row here."""

    def __init__(self, pred: Predictor):
        super().__init__()
        self.model, self.R = pred.model, pred.R
        self.register_buffer("seen", pred.seen)

    def forward(self, ids: torch.Tensor, vals: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        ids = torch.where(self.seen[ids], ids, ids - ids % self.R)
        return torch.sigmoid(self.model(ids, vals, dense))


def load_predictor(
    run_dir: str | Path,
    device: str | torch.device = "cpu",
    images: str | Path | None = None,
    image_cache: str | Path | None = None,
) -> Predictor:
    """``images`` / ``image_cache``: see `Predictor` (models trained with ``--image-features`` only)."""
    state, meta = load_exported(run_dir, app="pctr")
    return Predictor(state, meta, device, images, image_cache)
