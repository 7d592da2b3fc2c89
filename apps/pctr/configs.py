"""Typed configuration of `mariana pctr train`: the sections it composes (flags, TOML tables, presets).

The sections pCTR shares with `pctr stream` (`streams/config.py`) are defined here: the network (``net``),
the embedding table and its row optimiser (``table``), how values find rows (``rows``), the dense
optimiser (``optim``), the parameter servers (``ps``). Only the standard library here: `mariana pctr
train` checks its flags before torch is imported."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from mariana.platform.core.config import (
    RESUME_MAY_CHANGE,
    VALIDATES,
    WITHOUT_MAX_STEPS,
    DataSection,
    LoopSection,
    RunSection,
    Section,
    TrainJob,
    at_least,
    at_least_one,
    finite_non_negative,
    given,
    non_negative,
    not_with,
    only,
    opt,
    when,
)
from mariana.platform.core.endpoint import check_endpoint
from mariana.platform.core.errors import DataError, MarianaError
from mariana.platform.core.tracking import TrackingSection

MODELS = ("lr", "fm", "dnn", "deepfm", "dcn")
# the file names `pctr stream` takes for data by default (--files): the formats' usual suffixes, compressed
# too, and Criteo's ``day_N`` and Spark's ``part-N``; anything else in the folder (a README) is left alone
DATA_FILES = "*.tsv*,*.libfm*,*.csv*,day_*,part-*"
# --l2-emb when not given: it calibrates the models with embedding vectors; on --model lr it only shrinks the
# weights (measured on Frappe: apps/pctr/README.md, the default `--l2-emb`).
L2_EMB_DEFAULT = 0.01
MLP_MODELS = ("dnn", "deepfm", "dcn")  # the models with an MLP (--hidden, --dropout)


def parse_split(text: str) -> tuple[float, float, float]:
    """``"0.8,0.1,0.1"`` -> (train, val, test) fractions of the rows in file order; they must sum to 1."""
    try:
        parts = tuple(float(x) for x in text.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 3 or any(not (p >= 0) for p in parts) or abs(sum(parts) - 1.0) > 1e-6:
        raise DataError(f"--split must be three fractions train,val,test summing to 1, got {text!r}")
    return parts  # type: ignore[return-value]


@dataclass
class PctrRun(RunSection):
    """`RunSection` plus mixed precision (the platform's data-parallel section is not pCTR's)."""

    progress: bool = opt(True, "show a progress bar when stderr is a terminal (one process only)")
    amp: str = opt(
        "auto", "mixed precision: auto = bf16 autocast on GPU, off on CPU", ["auto", "bf16", "off"]
    )


@dataclass
class PctrData(DataSection):
    """Click logs (Criteo TSV or libFM) and how ``pctr train`` cuts and serves them."""

    data: str = opt(
        "",
        "training data: a file, a comma-separated list of files, or a folder of partitions (its files in "
        "name order, leaving out names starting with '.' or '_' and *.tmp/*.part); rows are the files' "
        "lines one after the other and --split applies to them",
        path=True,
    )
    format: str = opt("libfm", "input format of --data", ["criteo", "libfm"])
    num_fields: int = opt(
        0, "libFM: features per row (0: infer from the first lines)", applies=only("format", "libfm")
    )
    split: str = opt("0.8,0.1,0.1", "train,val,test fractions of the rows, in file order")
    val_rows: int = opt(
        0, "cap on validation rows scored for counters and early reports (0: all)", applies=VALIDATES
    )
    shuffle: bool = opt(True, "shuffle the batch order of epochs >= 2 (served from the row cache)")
    cache_gb: float | None = opt(
        None,
        "host RAM in GB the encoded training rows may take (per process; default: a quarter of this "
        "machine's RAM); beyond it they go to memory-mapped shards under RUN/row-cache/ (apps/pctr/README.md, Data)",
    )
    prefetch: int = opt(2, "batches parsed ahead of the training step by a background thread (0: no thread)")

    def validate(self) -> None:
        non_negative(self, ("num_fields", "val_rows", "prefetch"))
        parse_split(self.split)
        if self.cache_gb is not None:
            finite_non_negative(self, ("cache_gb",))


@dataclass
class Net(Section):
    """The click model on top of the embedding table."""

    NAME: ClassVar[str] = "net"
    TITLE: ClassVar[str] = "the click model"

    model: str = opt("deepfm", "model", list(MODELS))
    dim: int = opt(16, "embedding dimension", applies=not_with("model", "lr"))
    hidden: str = opt(
        "256,128", "MLP widths of dnn/deepfm/dcn, comma-separated", applies=only("model", *MLP_MODELS)
    )
    cross_layers: int = opt(3, "DCN-v2 cross layers", applies=only("model", "dcn"))
    dropout: float = opt(0.2, "MLP dropout", applies=only("model", *MLP_MODELS))
    compile: str = opt(
        "auto",
        "torch.compile the one-process step (one graph; with inductor on a GPU replayed as a CUDA graph): "
        "auto = on a GPU, where the step is launch-bound, off on the CPU, where the eager step updates only "
        "the batch's distinct rows (apps/pctr/README.md, GPU)",
        ["auto", "on", "off"],
        applies=only("servers", 0),
    )
    compile_backend: str = opt(
        "inductor",
        "torch.compile backend of the step (aot_eager compiles in seconds and captures no CUDA graph: tests)",
        ["inductor", "aot_eager"],
        applies=(only("servers", 0), not_with("compile", "off")),
    )

    def validate(self) -> None:
        at_least_one(self, ("dim",))
        non_negative(self, ("cross_layers",))
        if self.model == "dcn" and self.cross_layers < 1:
            raise MarianaError(f"--cross-layers must be >= 1 for --model dcn, got {self.cross_layers}")
        hidden_sizes(self.hidden, self.model)
        if not (0.0 <= self.dropout < 1.0):
            raise MarianaError(f"--dropout must be in [0, 1), got {self.dropout}")


def hidden_sizes(hidden: str, model: str) -> tuple[int, ...]:
    """``--hidden`` as layer widths (each >= 1); MarianaError naming the flag if it is not."""
    parts = [h.strip() for h in str(hidden).split(",") if h.strip()]
    try:
        sizes = tuple(int(h) for h in parts)
    except ValueError:
        raise MarianaError(
            f"--hidden must be comma-separated layer widths like 256,128, got {hidden!r}"
        ) from None
    if not sizes and model in MLP_MODELS:
        raise MarianaError(f"--hidden: --model {model} needs at least one layer width")
    if any(s < 1 for s in sizes):
        raise MarianaError(f"--hidden widths must be >= 1, got {hidden!r}")
    return sizes


@dataclass
class Table(Section):
    """The embedding table (one row per feature value: linear weight + embedding) and its row optimiser."""

    NAME: ClassVar[str] = "table"
    TITLE: ClassVar[str] = "embedding table and its row optimiser"

    sparse_optimizer: str = opt("adagrad", "row optimizer of the embedding table", ["sgd", "adagrad", "ftrl"])
    sparse_lr: float = opt(0.05, "learning rate of the embedding table")
    ftrl_l1: float = opt(0.0, "FTRL L1 strength", applies=only("sparse_optimizer", "ftrl"))
    ftrl_l2: float = opt(0.0, "FTRL L2 strength", applies=only("sparse_optimizer", "ftrl"))
    init_std: float = opt(0.01, "std of the initial embeddings")
    l2_emb: float | None = opt(
        None,
        "L2 strength on the embedding table: every step adds l2_emb * row to the gradient of each row the "
        "batch looks up (the gradient of l2_emb/2 * ||row||^2 over the batch's unique rows, linear weight "
        "included); it keeps the predicted probabilities calibrated over many epochs; 0 disables "
        f"(default: {L2_EMB_DEFAULT} for models with embedding vectors, 0 for --model lr, whose weights it "
        "only shrinks)",
    )

    def validate(self) -> None:
        finite_non_negative(self, ("sparse_lr", "init_std", "ftrl_l1", "ftrl_l2"))
        if self.l2_emb is not None:
            finite_non_negative(self, ("l2_emb",))


@dataclass
class Ids(Section):
    """How a field's values find their rows: hashing, or a dynamic id -> row map."""

    NAME: ClassVar[str] = "rows"
    TITLE: ClassVar[str] = "how values find their rows (--ids dynamic: admission and eviction)"

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
        "sightings (count-min estimate) before an id gets its own row; until then the OOV row",
        applies=only("ids", "dynamic"),
    )
    evict: str = opt(
        "lfu",
        "which row a newly admitted id takes once its field is full: the least frequently used (lfu, "
        "counts halved every 10 x --sketch-width sightings; taken only by an id counted more often than "
        "it) or the least recently used (lru)",
        ["lfu", "lru"],
        applies=only("ids", "dynamic"),
    )
    sketch_width: int = opt(
        1 << 18,
        "cells per row of the count-min sketch (4 rows) counting ids not admitted yet",
        applies=only("ids", "dynamic"),
    )

    def validate(self) -> None:
        if self.rows_per_field < 2:
            raise MarianaError(f"--rows-per-field must be >= 2, got {self.rows_per_field}")
        if self.admit_after < 1:
            raise MarianaError(
                f"--admit-after must be >= 1 (1: every id gets a row at once), got {self.admit_after}"
            )
        at_least_one(self, ("sketch_width",))


@dataclass
class DenseOptim(Section):
    """Batch size and the optimiser of the dense parameters (MLP, cross layers, biases)."""

    NAME: ClassVar[str] = "optim"
    TITLE: ClassVar[str] = "batch and dense optimiser"

    batch_size: int = opt(512, "samples per worker per step")
    optimizer: str = opt("adam", "optimizer of the dense parameters", ["sgd", "adam", "adagrad"])
    lr: float = opt(1e-3, "learning rate of the dense parameters")
    weight_decay: float = opt(
        0.0,
        "L2 strength on the dense parameters (MLP, cross layers, biases): adds weight_decay * p to their "
        "gradient before the optimiser (coupled L2, not AdamW's decoupled decay); 0 disables",
    )
    clip_grad: float = opt(
        0.0, "clip the norm of each step's gradient (dense parameters and the batch's rows); 0 disables"
    )

    def validate(self) -> None:
        at_least_one(self, ("batch_size",))
        finite_non_negative(self, ("lr", "weight_decay", "clip_grad"))


@dataclass
class Decay(Section):
    """The learning-rate schedule of one-process training (servers run at a constant rate)."""

    NAME: ClassVar[str] = "decay"
    TITLE: ClassVar[str] = "learning-rate schedule (one process only)"
    APPLIES: ClassVar[tuple] = (only("servers", 0),)

    schedule: str = opt(
        "cosine",
        "learning-rate schedule after warm-up, of the dense and the table learning rates, over --epochs (or "
        "--max-steps) whether or not early stopping ends the run sooner",
        ["constant", "cosine", "linear"],
    )
    warmup_steps: int = opt(0, "linear warm-up steps of both learning rates")

    def validate(self) -> None:
        non_negative(self, ("warmup_steps",))


def bounded_staleness(cfg) -> bool:
    """A pull may be sent a step early: not under bounded staleness (``--staleness s > 0``)."""
    return cfg.staleness <= 0


@dataclass
class StreamPS(Section):
    """Parameter servers and asynchronous workers (``--servers 0``: one process, none of the others)."""

    NAME: ClassVar[str] = "ps"
    TITLE: ClassVar[str] = "parameter servers (--servers >= 1)"
    APPLIES: ClassVar[tuple] = (at_least("servers", 1),)

    servers: int = opt(0, "parameter-server processes; 0 trains in this one process (CPU or CUDA)")
    workers: int = opt(1, "worker processes (each pulls/pushes asynchronously)")
    staleness: int = opt(-1, "-1 fully asynchronous; 0 bulk-synchronous (= synchronous SGD); s > 0 bounded")
    pull_ahead: bool = opt(
        True,
        "workers send step t+1's pull while step t computes (same result under --staleness 0; "
        "asynchronous: a worker's rows may miss its own last push)",
        applies=when("staleness", bounded_staleness, "--staleness -1 or 0 only", -1, 1),
    )
    max_restarts: int = opt(3, "group restarts after a failure (restore from checkpoint)")
    timeout: float = opt(300.0, "RPC and collective timeout in seconds: a process that stalls longer fails")

    def validate(self) -> None:
        non_negative(self, ("servers", "max_restarts"))
        at_least_one(self, ("workers",))
        if self.staleness < -1:
            raise MarianaError(f"--staleness must be -1, 0 or positive, got {self.staleness}")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise MarianaError(f"--timeout must be > 0 seconds, got {self.timeout}")


@dataclass
class PctrPS(StreamPS):
    """`StreamPS` plus nodes and rendezvous (``pctr train`` may spread servers and workers over nodes)."""

    nnodes: int = opt(1, "number of nodes (multi-node runs rendezvous at --rdzv-endpoint)")
    rdzv_endpoint: str = opt("", "host:port of the c10d rendezvous for multi-node runs")
    rdzv_id: str = opt(
        "mariana",
        "rendezvous id shared by all nodes of one job",
        applies=given("rdzv_endpoint", "127.0.0.1:29500"),
    )

    def validate(self) -> None:
        super().validate()
        at_least_one(self, ("nnodes",))
        if self.rdzv_endpoint:
            check_endpoint(self.rdzv_endpoint)
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise MarianaError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")


@dataclass
class Warm(Section):
    """What a warm start (``--init-from RUN``) takes from RUN besides its exported weights."""

    NAME: ClassVar[str] = "warm"
    TITLE: ClassVar[str] = "warm start from RUN's checkpoint (with --init-from, one process)"
    APPLIES: ClassVar[tuple] = (given("init_from"), only("servers", 0))

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


@dataclass
class Images(Section):
    """Image features of a vision run as dense inputs (see apps/pctr/README.md, Image features)."""

    NAME: ClassVar[str] = "image"
    TITLE: ClassVar[str] = "image features (with --image-features)"
    APPLIES: ClassVar[tuple] = (given("image_features", "VISION_RUN", image_field="C1", images=None),)

    image_features: str = opt(
        "",
        "run directory of a `mariana vision train` CNN: its penultimate-layer features of the image named by "
        "--image-field become dense inputs of the model (see apps/pctr/README.md, Image features)",
    )
    image_field: str = opt("", "the field naming the image (criteo C1..C26; libfm 1-based field)")
    images: str = opt("", "folder the image field's values resolve in (VALUE or VALUE.png/.jpg/.jpeg)")
    image_dims: int = opt(
        16, "PCA components (whitened) fitted on the training images; 0: the raw (centred) features"
    )
    image_cross: str = opt(
        "",
        "also cross the image features with this categorical field (e.g. a user segment; criteo C1..C26, "
        "libfm field number): one extra field per feature dimension, so LR learns per-segment image weights",
    )
    image_cache: str = opt("", "feature cache folder (default $MARIANA_CACHE or ~/.cache/mariana)")

    def validate(self) -> None:
        if self.image_features and not (self.image_field and self.images):
            raise MarianaError(
                "--image-features needs --image-field (the field naming the image) and --images DIR"
            )
        non_negative(self, ("image_dims",))


@dataclass
class PctrLoop(LoopSection):
    epochs: int = opt(
        30,
        "cap on passes over the training data (training stops earlier when --early-stop triggers)",
        applies=WITHOUT_MAX_STEPS,
    )
    eval_every: int = opt(
        -1,
        "validate every N steps, or 'epoch' at the end of every epoch; 0 only at the end",
        epoch_ok=True,
        applies=VALIDATES,
    )
    early_stop: int = opt(
        2,
        "stop after this many validations in a row without a better --monitor value; 0 never stops early",
        applies=VALIDATES,
    )
    ckpt_every: int = opt(
        0, "steps between checkpoints; 0: one at the end (one process) / none before the end (servers)"
    )


class PctrMethods:
    """What `pctr train` and `pctr stream` configs answer besides their fields."""

    def l2_emb_value(self) -> float:
        """``--l2-emb`` as used by the step: the value given, else 0 for ``--model lr`` and
        ``L2_EMB_DEFAULT`` for the models with embedding vectors."""
        if self.l2_emb is not None:  # type: ignore[attr-defined]
            return self.l2_emb  # type: ignore[attr-defined]
        return 0.0 if self.model == "lr" else L2_EMB_DEFAULT  # type: ignore[attr-defined]

    def check(self) -> None:
        """The cross-section check both commands share (each adds its own after it)."""
        super().check()  # type: ignore[misc]
        if self.init_train_state and not self.init_from:  # type: ignore[attr-defined]
            raise MarianaError(
                "--init-train-state needs --init-from RUN (the run whose training state to continue)"
            )


TRAIN_SECTIONS = (PctrRun, PctrData, Net, Table, Ids, DenseOptim, Decay, PctrLoop, PctrPS, Warm, Images)


class PctrConfig(PctrMethods, TrainJob, sections=(*TRAIN_SECTIONS, TrackingSection)):
    """``mariana pctr train``."""

    EVAL_METRICS: ClassVar[tuple[str, ...]] = ("auc", "logloss")
    # (a malformed --split is refused by parse_split here, in the words of PctrData.validate)
    VALIDATION: ClassVar[tuple] = (
        when("split", lambda c: parse_split(c.split)[1] > 0, "runs with validation rows (--split T,V,E with V > 0)",
             "0.8,0.1,0.1", "1,0,0"),
    )  # fmt: skip
    # `--resume` refuses any other difference from the checkpoint's RUN/config.toml (the model's shape, the
    # data and its split, batch size, optimisers and their settings, the process layout).
    RESUME_MAY_CHANGE: ClassVar[frozenset[str]] = RESUME_MAY_CHANGE | {
        "prefetch",
        "pull_ahead",
        "val_rows",
        "init_row_state",
        "init_train_state",
        "cache_gb",
        "compile",
        "compile_backend",
    }

    def check(self) -> None:
        super().check()
        if self.ids == "dynamic" and self.servers > 0 and self.init_from:
            raise MarianaError(
                "--init-from with --ids dynamic --servers >= 1 is not supported (the servers start with an "
                "empty id map); use --servers 0 to continue a dynamic-id model"
            )


PRESETS = {
    "debug": PctrConfig(
        batch_size=256,
        max_steps=20,
        dim=4,
        hidden="16",
        rows_per_field=1024,
        log_every=5,
        early_stop=0,
        dropout=0.0,
        schedule="constant",  # as the parameter-server paths, which the tests compare with it
    ),  # fmt: skip
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
