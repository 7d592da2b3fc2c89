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
# --l2-emb when not given: it calibrates the models with embedding vectors; on --model lr it only shrinks the
# weights (Frappe, PS LR 2x2 and one process: test AUC 0.887 with 0.01 vs 0.925 with 0; apps/pctr/README.md).
L2_EMB_DEFAULT = 0.01

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
    EVAL_METRICS: ClassVar[tuple[str, ...]] = ("auc", "logloss")
    # `--resume` refuses any other difference from the checkpoint's RUN/config.toml (the model's shape, the
    # data and its split, batch size, optimisers and their settings, the process layout).
    RESUME_MAY_CHANGE: ClassVar[frozenset[str]] = TrainConfig.RESUME_MAY_CHANGE | {
        "prefetch",
        "pull_ahead",
        "val_rows",
        "init_row_state",
        "init_train_state",
        "cache_gb",
    }

    data: str = opt(
        "",
        "training data: a file, a comma-separated list of files, or a folder of partitions (its files in "
        "name order, leaving out names starting with '.' or '_' and *.tmp/*.part); rows are the files' "
        "lines one after the other and --split applies to them",
        path=True,
    )
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
    ids: str = opt(
        "hash",
        "how values find their rows: hash (row = hash mod (rows-per-field - 1)) or dynamic (an id -> row map "
        "per field of rows-per-field - 1 rows: admission after --admit-after sightings, --evict of cold "
        "rows; with --servers the map lives on server 0; see apps/pctr/README.md, Dynamic ids)",
        ["hash", "dynamic"],
    )
    admit_after: int = opt(
        2,
        "--ids dynamic: sightings (count-min estimate) before an id gets its own row; until then the OOV row",
    )
    evict: str = opt(
        "lfu",
        "--ids dynamic: which row a newly admitted id takes once its field is full: the least frequently "
        "used (lfu, counts halved every 10 x --sketch-width sightings; taken only by an id counted more "
        "often than it) or the least recently used (lru)",
        ["lfu", "lru"],
    )
    sketch_width: int = opt(
        1 << 18, "--ids dynamic: cells per row of the count-min sketch (4 rows) counting ids not admitted yet"
    )
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
    init_train_state: bool = opt(
        False,
        "with --init-from RUN: continue RUN's whole training state from its latest one-process checkpoint "
        "(table, seen flags, dense weights, row-optimiser state and the dense optimiser's Adam moments and "
        "step) instead of only its exported weights: day-by-day incremental training",
    )
    ckpt_every: int = opt(
        0, "steps between checkpoints; 0: one at the end (one process) / none before the end (servers)"
    )
    l2_emb: float | None = opt(
        None,
        "L2 strength on the embedding table: every step adds l2_emb * row to the gradient of each row the "
        "batch looks up (the gradient of l2_emb/2 * ||row||^2 over the batch's unique rows, linear weight "
        "included); it keeps the predicted probabilities calibrated over many epochs; 0 disables "
        f"(default: {L2_EMB_DEFAULT} for models with embedding vectors, 0 for --model lr, whose weights it "
        "only shrinks)",
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
    shuffle: bool = opt(True, "shuffle the batch order of epochs >= 2 (served from the row cache)")
    cache_gb: float | None = opt(
        None,
        "host RAM in GB the encoded training rows may take (per process; default: a quarter of this "
        "machine's RAM); beyond it they go to memory-mapped shards under RUN/row-cache/ (apps/pctr/README.md, Data)",
    )
    prefetch: int = opt(2, "batches parsed ahead of the training step by a background thread (0: no thread)")
    val_rows: int = opt(0, "cap on validation rows scored for counters and early reports (0: all)")
    image_features: str = opt(
        "",
        "run directory of a `mariana vision train` CNN: its penultimate-layer features of the image named by "
        "--image-field become dense inputs of the model (see apps/pctr/README.md, Image features)",
    )
    image_field: str = opt(
        "", "with --image-features: the field naming the image (criteo C1..C26; libfm 1-based field)"
    )
    images: str = opt(
        "",
        "with --image-features: folder the image field's values resolve in (VALUE or VALUE.png/.jpg/.jpeg)",
    )
    image_dims: int = opt(
        16,
        "with --image-features: PCA components (whitened) fitted on the training images; 0: the raw (centred) features",
    )
    image_cross: str = opt(
        "",
        "with --image-features: also cross the image features with this categorical field (e.g. a user "
        "segment; criteo C1..C26, libfm field number): one extra field per feature dimension, so LR learns "
        "per-segment image weights",
    )
    image_cache: str = opt(
        "", "with --image-features: feature cache folder (default $MARIANA_CACHE or ~/.cache/mariana)"
    )
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
        if self.cache_gb is not None and not (math.isfinite(self.cache_gb) and self.cache_gb >= 0):
            raise MarianaError(f"--cache-gb must be a finite number >= 0, got {self.cache_gb}")
        for name in ("num_fields", "cross_layers", "prefetch", "val_rows"):
            if getattr(self, name) < 0:
                raise MarianaError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.model == "dcn" and self.cross_layers < 1:
            raise MarianaError(f"--cross-layers must be >= 1 for --model dcn, got {self.cross_layers}")
        self.hidden_sizes()
        for name in ("sparse_lr", "init_std", "ftrl_l1", "ftrl_l2", "l2_emb"):
            v = self.l2_emb_value() if name == "l2_emb" else getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise MarianaError(f"--{_flag(name)} must be a finite number >= 0, got {v}")
        if not (0.0 <= self.dropout < 1.0):
            raise MarianaError(f"--dropout must be in [0, 1), got {self.dropout}")
        parse_split(self.split)
        if self.init_train_state and not self.init_from:
            raise MarianaError(
                "--init-train-state needs --init-from RUN (the run whose training state to continue)"
            )
        if self.admit_after < 1:
            raise MarianaError(
                f"--admit-after must be >= 1 (1: every id gets a row at once), got {self.admit_after}"
            )
        if self.sketch_width < 1:
            raise MarianaError(f"--sketch-width must be >= 1, got {self.sketch_width}")
        if self.ids == "dynamic" and self.servers > 0 and self.init_from:
            raise MarianaError(
                "--init-from with --ids dynamic --servers >= 1 is not supported (the servers start with an "
                "empty id map); use --servers 0 to continue a dynamic-id model"
            )
        if self.image_features and not (self.image_field and self.images):
            raise MarianaError(
                "--image-features needs --image-field (the field naming the image) and --images DIR"
            )
        if (self.image_field or self.images or self.image_cross) and not self.image_features:
            raise MarianaError("--image-field/--images/--image-cross need --image-features VISION_RUN")
        if self.image_dims < 0:
            raise MarianaError(f"--image-dims must be >= 0, got {self.image_dims}")
        if self.servers > 0:
            for name, default in (
                ("schedule", "constant"),
                ("warmup_steps", 0),
                ("init_row_state", False),
                ("init_train_state", False),
            ):
                if getattr(self, name) != default:
                    raise MarianaError(
                        f"--{_flag(name)} is not supported with --servers >= 1 (the servers' optimisers run "
                        "at a constant learning rate and hold the row state); use --servers 0"
                    )

    def l2_emb_value(self) -> float:
        """``--l2-emb`` as used by the step: the value given, else 0 for ``--model lr`` and
        ``L2_EMB_DEFAULT`` for the models with embedding vectors."""
        if self.l2_emb is not None:
            return self.l2_emb
        return 0.0 if self.model == "lr" else L2_EMB_DEFAULT

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
