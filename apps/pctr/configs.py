"""Typed configuration of `mariana pctr train` (flat dataclass; flags, TOML and presets)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mariana.platform.core.config import TrainConfig, opt
from mariana.platform.core.errors import MarianaError

from .model import MODELS


@dataclass
class PctrConfig(TrainConfig):
    format: str = opt("libfm", "input format of --data", ["criteo", "libfm"])
    model: str = opt("deepfm", "model", list(MODELS))
    servers: int = opt(0, "parameter-server processes; 0 trains in this one process (CPU or CUDA)")
    workers: int = opt(1, "worker processes (with --servers >= 1; each pulls/pushes asynchronously)")
    max_restarts: int = opt(
        3, "parameter-server mode: group restarts after a failure (restore from checkpoint)"
    )
    staleness: int = opt(-1, "-1 fully asynchronous; 0 bulk-synchronous (= synchronous SGD); s > 0 bounded")
    split: str = opt("0.8,0.1,0.1", "train,val,test fractions of the rows, in file order")
    rows_per_field: int = opt(1 << 16, "hash space (embedding rows) per field, incl. 1 missing/OOV row")
    num_fields: int = opt(0, "libFM: features per row (0: infer from the first lines)")
    dim: int = opt(16, "embedding dimension (ignored by lr)")
    hidden: str = opt("256,128", "MLP widths of dnn/deepfm/dcn, comma-separated")
    cross_layers: int = opt(3, "DCN-v2 cross layers")
    dropout: float = opt(0.0, "MLP dropout")
    init_std: float = opt(0.01, "std of the initial embeddings")
    optimizer: str = opt("adam", "optimizer of the dense parameters", ["sgd", "adam", "adagrad"])
    lr: float = opt(1e-3, "learning rate of the dense parameters")
    sparse_optimizer: str = opt("adagrad", "row optimizer of the embedding table", ["sgd", "adagrad", "ftrl"])
    sparse_lr: float = opt(0.05, "learning rate of the embedding table")
    ftrl_l1: float = opt(0.0, "FTRL L1 strength")
    ftrl_l2: float = opt(0.0, "FTRL L2 strength")
    batch_size: int = opt(512, "samples per worker per step")
    shuffle: bool = opt(True, "shuffle the batch order of epochs >= 2 (served from the in-memory cache)")
    prefetch: int = opt(2, "batches parsed ahead of the training step by a background thread")
    val_rows: int = opt(0, "cap on validation rows scored for counters and early reports (0: all)")

    def validate(self) -> None:
        super().validate()
        if self.servers < 0:
            raise MarianaError(f"--servers must be >= 0, got {self.servers}")
        if self.servers == 0 and self.workers > 1:
            raise MarianaError("--workers > 1 needs --servers >= 1 (the embedding tables live on servers)")
        if self.rows_per_field < 2:
            raise MarianaError(f"--rows-per-field must be >= 2, got {self.rows_per_field}")
        if self.staleness < -1:
            raise MarianaError(f"--staleness must be -1, 0 or positive, got {self.staleness}")


PRESETS = {
    "debug": PctrConfig(batch_size=256, max_steps=20, dim=4, hidden="16", rows_per_field=1024, log_every=5),
    "frappe": PctrConfig(
        batch_size=512,
        epochs=10,
        dim=16,
        hidden="256,128",
        rows_per_field=1 << 13,
        lr=1e-3,
        sparse_lr=0.05,
        log_every=50,
    ),
}


def with_defaults(**kw) -> PctrConfig:
    return replace(PctrConfig(), **kw)
