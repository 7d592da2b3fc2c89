"""Typed configuration of `mariana pctr train` (flat dataclass; flags, TOML and presets)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace
from typing import ClassVar

from mariana.platform.core.config import TrainConfig, opt
from mariana.platform.core.errors import DataError, MarianaError

# Only the standard library here: `mariana pctr train` checks its flags before torch is imported.
MODELS = ("lr", "fm", "dnn", "deepfm", "dcn")

# TrainConfig fields pCTR has no use for, with why. They are hidden from `--help` (cli=False) and a
# non-default value (possible only through --config TOML or a preset) is refused by `validate`.
UNUSED = {
    "grad_comm": "there is no gradient all-reduce (rows and dense gradients go to a local shard or servers)",
    "grad_accum": "every batch is one pull/push of its rows",
    "momentum": "the dense sgd optimiser has no momentum",
    "num_workers": "batches are parsed by one background thread (--prefetch)",
}


def _unused(help: str, default):
    return opt(default, help, cli=False)


@dataclass
class PctrConfig(TrainConfig):
    # `--resume` refuses any other difference from the checkpoint's RUN/config.toml (the model's shape, the
    # data and its split, batch size, optimisers and their settings, the process layout).
    RESUME_MAY_CHANGE: ClassVar[frozenset[str]] = TrainConfig.RESUME_MAY_CHANGE | {
        "prefetch",
        "pull_ahead",
        "val_rows",
        "init_row_state",
    }

    format: str = opt("libfm", "input format of --data", ["criteo", "libfm"])
    model: str = opt("deepfm", "model", list(MODELS))
    servers: int = opt(0, "parameter-server processes; 0 trains in this one process (CPU or CUDA)")
    workers: int = opt(1, "worker processes (with --servers >= 1; each pulls/pushes asynchronously)")
    max_restarts: int = opt(
        3, "parameter-server mode: group restarts after a failure (restore from checkpoint)"
    )
    staleness: int = opt(-1, "-1 fully asynchronous; 0 bulk-synchronous (= synchronous SGD); s > 0 bounded")
    pull_ahead: bool = opt(
        True,
        "parameter-server workers send step t+1's pull while step t computes (same result under "
        "--staleness 0; asynchronous: a worker's rows may miss its own last push; not with --staleness s > 0)",
    )
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
    schedule: str = opt(
        "constant",
        "learning-rate schedule after warm-up, of the dense and the table learning rates (one process only)",
        ["constant", "cosine", "linear"],
    )
    warmup_steps: int = opt(0, "linear warm-up steps of both learning rates (one process only)")
    clip_grad: float = opt(
        0.0, "clip the norm of each step's gradient (dense parameters and the batch's rows); 0 disables"
    )
    epochs: int = opt(
        30, "cap on passes over the training data (training stops earlier when --early-stop triggers)"
    )
    eval_every: int = opt(
        -1,
        "validate every N steps, or 'epoch' at the end of every epoch; 0 only at the end",
        epoch_ok=True,
    )
    early_stop: int = opt(
        2, "stop after this many validations in a row without a better --monitor value; 0 never stops early"
    )
    init_row_state: bool = opt(
        False,
        "with --init-from RUN: also take the table's row-optimiser state (Adagrad accumulators, FTRL z/n) "
        "from RUN's latest one-process checkpoint",
    )
    ckpt_every: int = opt(
        0, "steps between checkpoints; 0: one at the end (one process) / none before the end (servers)"
    )
    l2_emb: float = opt(
        0.01,
        "L2 strength on the embedding table: every step adds l2_emb * row to the gradient of each row the "
        "batch looks up (the gradient of l2_emb/2 * ||row||^2 over the batch's unique rows, linear weight "
        "included); it keeps the predicted probabilities calibrated over many epochs; 0 disables",
    )
    weight_decay: float = opt(
        0.0,
        "L2 strength on the dense parameters (MLP, cross layers, biases): adds weight_decay * p to their "
        "gradient before the optimiser (coupled L2, not AdamW's decoupled decay); 0 disables",
    )
    sparse_optimizer: str = opt("adagrad", "row optimizer of the embedding table", ["sgd", "adagrad", "ftrl"])
    sparse_lr: float = opt(0.05, "learning rate of the embedding table")
    ftrl_l1: float = opt(0.0, "FTRL L1 strength")
    ftrl_l2: float = opt(0.0, "FTRL L2 strength")
    batch_size: int = opt(512, "samples per worker per step")
    shuffle: bool = opt(True, "shuffle the batch order of epochs >= 2 (served from the in-memory cache)")
    prefetch: int = opt(2, "batches parsed ahead of the training step by a background thread (0: no thread)")
    val_rows: int = opt(0, "cap on validation rows scored for counters and early reports (0: all)")
    progress: bool = opt(True, "show a progress bar when stderr is a terminal (one process only)")
    grad_comm: str = _unused("not used by pctr", "fp32")
    grad_accum: int = _unused("not used by pctr", 1)
    momentum: float = _unused("not used by pctr", 0.9)
    num_workers: int = _unused("not used by pctr", 0)

    def validate(self) -> None:
        self._check_unused()
        super().validate()
        if self.servers < 0:
            raise MarianaError(f"--servers must be >= 0, got {self.servers}")
        if self.servers == 0 and self.workers > 1:
            raise MarianaError("--workers > 1 needs --servers >= 1 (the embedding tables live on servers)")
        if self.rows_per_field < 2:
            raise MarianaError(f"--rows-per-field must be >= 2, got {self.rows_per_field}")
        if self.staleness < -1:
            raise MarianaError(f"--staleness must be -1, 0 or positive, got {self.staleness}")
        for name in ("dim",):
            if getattr(self, name) < 1:
                raise MarianaError(f"--{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("num_fields", "cross_layers", "prefetch", "val_rows"):
            if getattr(self, name) < 0:
                raise MarianaError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.model == "dcn" and self.cross_layers < 1:
            raise MarianaError(f"--cross-layers must be >= 1 for --model dcn, got {self.cross_layers}")
        self.hidden_sizes()
        for name in ("sparse_lr", "init_std", "ftrl_l1", "ftrl_l2", "l2_emb"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise MarianaError(f"--{_flag(name)} must be a finite number >= 0, got {v}")
        if not (0.0 <= self.dropout < 1.0):
            raise MarianaError(f"--dropout must be in [0, 1), got {self.dropout}")
        parse_split(self.split)
        if self.servers > 0:
            for name, default in (("schedule", "constant"), ("warmup_steps", 0), ("init_row_state", False)):
                if getattr(self, name) != default:
                    raise MarianaError(
                        f"--{_flag(name)} is not supported with --servers >= 1 (the servers' optimisers run "
                        "at a constant learning rate and hold the row state); use --servers 0"
                    )

    def hidden_sizes(self) -> tuple[int, ...]:
        """``--hidden`` as layer widths (each >= 1); MarianaError naming the flag if it is not."""
        parts = [h.strip() for h in str(self.hidden).split(",") if h.strip()]
        try:
            sizes = tuple(int(h) for h in parts)
        except ValueError:
            raise MarianaError(
                f"--hidden must be comma-separated layer widths like 256,128, got {self.hidden!r}"
            ) from None
        if not sizes and self.model in ("dnn", "deepfm", "dcn"):
            raise MarianaError(f"--hidden: --model {self.model} needs at least one layer width")
        if any(s < 1 for s in sizes):
            raise MarianaError(f"--hidden widths must be >= 1, got {self.hidden!r}")
        return sizes

    def _check_unused(self) -> None:
        for f in dataclasses.fields(self):
            if f.name in UNUSED and getattr(self, f.name) != f.default:
                raise MarianaError(
                    f"field {f.name!r} = {getattr(self, f.name)!r}: {f.name} is not used by pctr "
                    f"({UNUSED[f.name]}); remove it"
                )


def parse_split(text: str) -> tuple[float, float, float]:
    """``"0.8,0.1,0.1"`` -> (train, val, test) fractions of the rows in file order; they must sum to 1."""
    try:
        parts = tuple(float(x) for x in text.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 3 or any(not (p >= 0) for p in parts) or abs(sum(parts) - 1.0) > 1e-6:
        raise DataError(f"--split must be three fractions train,val,test summing to 1, got {text!r}")
    return parts  # type: ignore[return-value]


def _flag(name: str) -> str:
    return name.replace("_", "-")


PRESETS = {
    "debug": PctrConfig(
        batch_size=256, max_steps=20, dim=4, hidden="16", rows_per_field=1024, log_every=5, early_stop=0
    ),
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
