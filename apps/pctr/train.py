"""Training of the click models in one process (CPU or CUDA), on the one platform `Trainer`.

The step (`step.LocalStep`) pulls the unique rows of a batch from the local table, runs the model and
pushes exactly those rows' gradients to the row optimiser; dense parameters use a torch optimiser. The
parameter-server mode runs the same step math in `ps.py`.

Data: the training split is streamed in row order in epoch 1 (parsed by a background thread ahead of the
step) and kept, already encoded, in memory; later epochs read that cache (shuffled batch order). Worker w
of W takes global batches g with g % W == w. By default the model is evaluated on the validation split at
the end of every epoch, training stops once validation AUC has not improved for ``--early-stop``
evaluations (``--epochs`` is the cap), and the best model is exported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from mariana.platform.core.errors import DataError, MarianaError
from mariana.platform.core.evaluator import evaluator_from
from mariana.platform.core.export import export_model
from mariana.platform.core.loop import Trainer
from mariana.platform.core.metrics import auc_logloss
from mariana.platform.core.prefetch import Prefetcher
from mariana.platform.core.rundir import RunDir, setup_logging
from mariana.platform.core.tiers import host_budget_gb
from mariana.platform.core.warmstart import load_init
from mariana.platform.data.shards import BatchStore
from mariana.platform.ps.loader import PullAheadLoader
from mariana.platform.ps.local import LocalStep
from mariana.platform.ps.memory import keep_freed_memory
from mariana.platform.ps.protocol import TABLE
from mariana.platform.ps.pull import predict_batches
from mariana.platform.ps.shard import TableSpec, contiguous_part
from mariana.platform.runtime.dist import DistContext, resolve_device

from .configs import PctrConfig
from .data import (
    Batch,
    Encoder,
    ReadStats,
    count_lines,
    infer_schema,
    iter_batches,
    iter_chunks,
    load_split,
    parse_split,
    split_bounds,
)
from .images import setup_image_features
from .model import CTRModel
from .sources import resolve_sources
from .step import make_local_step

log = logging.getLogger("mariana")


# --------------------------------------------------------------------------- data
def shard_lines(start: int, stop: int, worker: int, num_workers: int) -> tuple[int, int]:
    """Worker ``worker`` of ``num_workers``'s contiguous part ``[lo, hi)`` of lines ``[start, stop)``:
    the parts are disjoint, cover the range, and differ in length by at most one line."""
    lo, hi = contiguous_part(stop - start, worker, num_workers)
    return start + lo, start + hi


def encoding_key(encoder: Encoder) -> dict:
    """What turns lines into rows (the schema; with --image-features the CNN and the fitted projection):
    part of the fingerprint of cached rows, so a changed encoding never reads rows of the old one."""
    image = None
    if encoder.image is not None:
        img = encoder.image
        proj = [t.detach().cpu().numpy().tobytes() for t in (img.proj_mean, img.proj) if t is not None]
        image = {**img.meta(), "projection": hashlib.sha256(b"".join(proj)).hexdigest()}
    return {"schema": encoder.schema.to_dict(), "image": image}


class WorkerData:
    """Worker ``w`` of ``W``'s share of the training rows ``[start, stop)`` in batches of ``batch_size``.

    The share is a contiguous range of lines, the ``w``-th of ``W`` near-equal parts, so workers parse
    disjoint parts of the file (the lines before a share are only counted, never parsed). Every worker
    runs the same ``steps_per_epoch`` (what bulk-synchronous training needs); with shuffling, a share's
    whole batches beyond ``steps_per_epoch`` are cached and take turns in later epochs. ``batches(epoch, skip)``
    yields ``steps_per_epoch`` batches; epoch 0 streams the share (and fills the cache), later epochs come
    from the cache (on ``cache_device``)."""

    def __init__(
        self,
        path,
        encoder: Encoder,
        start: int,
        stop: int,
        batch_size: int,
        worker: int = 0,
        num_workers: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        cache_device="cpu",
        cache_gb: float | None = None,
        cache_dir=None,
    ):
        self.path, self.encoder = path, encoder
        self.bs, self.w, self.W, self.seed, self.shuffle = batch_size, worker, num_workers, seed, shuffle
        self.stats = ReadStats()
        self.steps_per_epoch = max(1, ((stop - start) // batch_size) // num_workers)
        self.lo, self.hi = shard_lines(start, stop, worker, num_workers)
        # the encoded rows: on the device / in RAM up to --cache-gb, else memory-mapped shards in cache_dir
        # (reused by a resumed run when source and encoding are unchanged; `close` deletes them)
        key = {"encoding": encoding_key(encoder), "lines": [self.lo, self.hi], "batch": batch_size}
        self.cache = BatchStore(
            cache_dir, ("ids", "vals", "dense", "labels"), Batch, resolve_sources(path).paths, key,
            self.hi - self.lo, host_budget_gb(cache_gb), cache_device,
        )  # fmt: skip
        if self.cache.complete:  # a whole store from an earlier attempt of this run: its read statistics
            log.info("worker %d: %d encoded batches reused from %s", worker, len(self.cache), cache_dir)
            s = self.cache.extra["stats"]
            self.stats = ReadStats(s["rows"], s["skipped"], {int(k): v for k, v in s["errors"].items()})

    def _stream(self) -> Iterator[Batch]:
        chunks = iter_chunks(self.path, self.encoder, self.lo, self.hi, stats=self.stats)
        for b in iter_batches(chunks, self.bs, drop_last=True):
            yield self.cache.append(b)
        self.cache.finish({"stats": dataclasses.asdict(self.stats)})
        log.info("worker %d: %d encoded batches kept (%s tier)", self.w, len(self.cache), self.cache.tier)
        if not len(self.cache):
            raise DataError(
                f"{self.path}: no valid rows for worker {self.w} in lines {self.lo + 1}-{self.hi}"
            )

    def batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        n = self.steps_per_epoch
        if epoch == 0 and not self.cache.complete:
            self.cache.clear()
            k = 0
            for b in self._stream():
                if k >= n:
                    continue  # keep caching the rest of this worker's rows
                if k >= skip:
                    yield b
                k += 1
            # malformed lines may leave fewer batches than planned: top up from the cache
            while k < n:
                if k >= skip:
                    yield self.cache[k % len(self.cache)]
                k += 1
            return
        if not self.cache.complete:
            for _ in self._stream():
                pass
        m = len(self.cache)
        order = np.arange(max(n, m)) % m
        if self.shuffle and epoch > 0:  # epoch 0 from a reused store: the order streaming yields
            order = np.random.default_rng(self.seed * 1009 + epoch).permutation(order)
        for k in range(skip, n):
            yield self.cache[order[k]]

    def close(self) -> None:
        """The run is over: drop the cached rows and delete their shards (and their parent folder, once
        every worker's is gone)."""
        folder = self.cache.folder
        self.cache.close()
        if folder is not None:
            with contextlib.suppress(OSError):
                folder.parent.rmdir()


class PctrLoader:
    """`BatchLoader` over `WorkerData`: epoch 1 is parsed by a background thread (`Prefetcher`)."""

    def __init__(self, data: WorkerData, prefetch: int):
        self.data, self.prefetch = data, prefetch
        self.batches_per_epoch = data.steps_per_epoch

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        gen = self.data.batches(epoch, start)
        if epoch == 0 and self.prefetch > 0 and not self.data.cache.complete:
            return Prefetcher(gen, self.prefetch)
        return gen


# --------------------------------------------------------------------------- shared set-up
class Setup:
    def __init__(self, cfg: PctrConfig):
        self.cfg = cfg
        self.schema = infer_schema(cfg.data, cfg.format, cfg.rows_per_field, cfg.num_fields)
        self.schema.ids = getattr(cfg, "ids", "hash")  # "dynamic": the encoder emits keys (idmap.py)
        self.idmap = None  # `--ids dynamic`: the trainer's `idmap.IdMap` (set by LocalStep; exported)
        self.encoder = Encoder(self.schema)
        # --data: a file, a comma-separated list or a folder of partitions, read as one sequence of lines
        self.sources = resolve_sources(cfg.data)
        self.lines = count_lines(self.sources)
        self.bounds = split_bounds(self.lines, parse_split(cfg.split))
        # `--image-features`: images.ImageFeatures; adds to schema.num_dense (and num_fields with
        # --image-cross), so before the table's spec
        self.image = None
        if getattr(cfg, "image_features", ""):
            self.image = setup_image_features(cfg, self.schema, self.encoder, self.bounds["train"])
        self.spec = TableSpec(
            TABLE, self.schema.num_rows, 1 + (0 if cfg.model == "lr" else cfg.dim), cfg.init_std
        )
        self.val_stats = ReadStats()

    def check_batch_size(self) -> None:
        """Every worker gets at least one full batch per epoch from the training split, or MarianaError."""
        a, b = self.bounds["train"]
        need = self.cfg.batch_size * max(1, self.cfg.workers if self.cfg.servers else 1)
        if b - a < need:
            per = f" x {self.cfg.workers} workers" if self.cfg.servers and self.cfg.workers > 1 else ""
            raise MarianaError(
                f"--batch-size {self.cfg.batch_size}{per} is larger than the training split of {self.cfg.data}: "
                f"{b - a} of its {self.lines} lines (--split {self.cfg.split}); use a smaller --batch-size"
            )

    def val_batches(self, device) -> tuple[list[Batch], np.ndarray]:
        a, b = self.bounds["val"]
        if self.cfg.val_rows:
            b = min(b, a + self.cfg.val_rows)
        self.val_stats = ReadStats()
        val = load_split(self.sources, self.encoder, a, b, stats=self.val_stats)
        bs = 8192
        batches = [val.slice(i, i + bs).to(device) for i in range(0, len(val), bs)]
        return batches, val.labels.numpy()

    def total_steps(self, steps_per_epoch: int) -> int:
        return self.cfg.max_steps if self.cfg.max_steps > 0 else self.cfg.epochs * steps_per_epoch

    def meta(self, extra: dict | None = None) -> dict:
        cfg = dataclasses.asdict(self.cfg)
        return {
            "app": "pctr",
            "format": self.schema.format,
            "schema": self.schema.to_dict(),
            "model": {
                "kind": self.cfg.model,
                "dim": self.cfg.dim,
                "hidden": self.cfg.hidden,
                "cross_layers": self.cfg.cross_layers,
                "dropout": self.cfg.dropout,
            },
            "config": cfg,
            **({"image": self.image.meta()} if self.image is not None else {}),
            **(extra or {}),
        }


def export(run: RunDir, setup: Setup, model: CTRModel, table: torch.Tensor, seen: torch.Tensor, extra=None):
    sd = {k: v for k, v in model.state_dict().items() if k != "table.weight"}
    sd["table.weight"] = table
    sd["seen"] = seen.to(torch.uint8)
    if getattr(setup, "idmap", None) is not None:  # `--ids dynamic`: the key held by each row, -1 none
        sd["idmap.row_key"] = torch.from_numpy(setup.idmap.row_key.copy())
    if setup.image is not None:  # the CNN and projection: serving computes the same features
        sd.update(setup.image.state())
    meta = setup.meta(extra)
    export_model(
        run.path,
        sd,
        app="pctr",
        arch=meta["model"]["kind"],
        config=meta["config"],
        metrics=meta.get("metrics"),
        extra=meta,
    )


def warm_start(step, setup: Setup, cfg: PctrConfig) -> None:
    """``--init-from``: table rows, ``seen`` flags and dense weights of an earlier pctr model; with
    ``--init-row-state`` also the table's row-optimiser state (Adagrad accumulators, FTRL z/n) from the
    source run's latest one-process checkpoint."""
    state, meta = load_init(cfg.init_from, "pctr")
    table, seen = state.pop("table.weight", None), state.pop("seen", None)
    row_key = state.pop("idmap.row_key", None)
    if (row_key is not None) != (getattr(step, "idmap", None) is not None):
        raise MarianaError(
            f"--init-from {cfg.init_from}: it was trained with --ids {'dynamic' if row_key is not None else 'hash'}"
            f", this run has --ids {cfg.ids}; rows mean different ids: use the same --ids"
        )
    live = step.model.table.weight.data
    if table is None or seen is None:
        raise MarianaError(f"--init-from {cfg.init_from}: the model lacks its embedding table")
    if tuple(table.shape) != tuple(live.shape):
        raise MarianaError(
            f"--init-from {cfg.init_from}: its table is {tuple(table.shape)} (rows, 1 + dim), this "
            f"configuration's is {tuple(live.shape)}; use the same --rows-per-field, --dim and fields"
        )
    try:
        step.model.load_dense_state_dict(state)
    except (RuntimeError, KeyError) as e:
        raise MarianaError(
            f"--init-from {cfg.init_from}: dense layers do not fit this model ({str(e).splitlines()[0]})"
        ) from None
    live.copy_(table)
    step.shard.seen[TABLE].copy_(seen.bool())
    if row_key is not None:  # the rows' ids (counts restart; --init-row-state below takes them too)
        try:
            step.idmap.load_rows(row_key.numpy())
        except ValueError as e:
            raise MarianaError(f"--init-from {cfg.init_from}: {e}") from None
    if getattr(cfg, "init_train_state", False):
        at = continue_training_state(step, cfg)
        log.info(
            "warm start from %s: its whole training state at step %d (weights, row and dense optimiser state; "
            "--init-train-state)",
            cfg.init_from,
            at,
        )
        return
    if cfg.init_row_state:
        ck, src = _latest_checkpoint(cfg.init_from, "--init-row-state")
        try:
            step.load_row_state(ck["rows"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise MarianaError(f"--init-row-state: {src}: {str(e).splitlines()[0]}") from None
    log.info("warm start from %s (%s)", cfg.init_from, meta.get("version", "?"))


def _latest_checkpoint(init_from: str, flag: str) -> tuple[dict, Path]:
    """(state.pt of the latest one-process checkpoint of the run ``init_from`` names (its folder or a file
    in it), that run's folder); MarianaError naming ``flag`` when there is none."""
    src = Path(init_from)
    src = src.parent if src.is_file() else src
    latest = src / "checkpoints" / "latest"
    if not latest.is_file():
        raise MarianaError(f"{flag}: {src} has no one-process checkpoint to take it from")
    folder = src / "checkpoints" / latest.read_text().strip()
    try:
        ck = torch.load(folder / "state.pt", map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as e:
        raise MarianaError(f"{flag}: checkpoint {folder} cannot be read: {e}") from None
    if "rows" not in ck or "dense_opt" not in ck:
        raise MarianaError(f"{flag}: {folder} is not a one-process pctr checkpoint")
    return ck, src


def continue_training_state(step, cfg: PctrConfig) -> int:
    """``--init-from RUN --init-train-state``: load RUN's latest one-process checkpoint into ``step`` (a
    `LocalStep`): model and table, ``seen`` flags (and the id map), the row-optimiser state (Adagrad
    accumulators / FTRL z, n) and the dense optimiser's state (Adam moments and step count), so training
    goes on as if RUN had continued on this run's data. The hyper-parameters (learning rates, betas, ...)
    stay this run's; the learning-rate schedule and step counter start over. Returns the checkpoint's step.

    The weights come from the checkpoint, not from RUN's export: the two differ when RUN exported an
    earlier, better-validated step, and optimiser state only fits the weights it was accumulated with."""
    ck, src = _latest_checkpoint(cfg.init_from, "--init-train-state")
    opt = step.dense_opt
    mine = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    try:
        saved = [set(g) - {"params", "initial_lr"} for g in ck["dense_opt"]["param_groups"]]
        if saved != [set(g) for g in mine]:  # another optimiser class: its state would be silently unused
            raise ValueError(
                f"the dense optimiser differs (its settings are {sorted(saved[0]) if saved else []})"
            )
        step.model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["dense_opt"])
        step.load_row_state(ck["rows"])
    except (KeyError, ValueError, RuntimeError) as e:
        raise MarianaError(
            f"--init-train-state: {src}'s checkpoint does not fit this model ({str(e).splitlines()[0]}); "
            "use the same --model, --rows-per-field, --dim, --hidden, --optimizer and --sparse-optimizer"
        ) from None
    for g, keep in zip(opt.param_groups, mine):  # this run's settings, not the saved ones
        g.pop("initial_lr", None)  # a scheduler of the source run left it; ours sets it from lr
        g.update(keep)
    return int(ck.get("step", ck.get("t", 0)))


def make_trainer(cfg, step, data: WorkerData, ctx, run, validate, exporter, total: int, checkpointer=None):
    """The platform `Trainer` over this process's batches; ``validate`` is None without validation rows."""
    if validate is None and cfg.early_stop:
        # No validation rows (e.g. --split 1,0,0, a day of logs trained on in full): nothing to stop early
        # on, so the run makes its --epochs passes and exports the final model.
        log.info("no validation rows: no early stopping; the final model is exported")
        cfg = dataclasses.replace(cfg, early_stop=0)
    loader = PctrLoader(data, cfg.prefetch)
    if getattr(step, "pulls_ahead", False):
        loader = PullAheadLoader(loader, step)
    return Trainer(
        cfg,
        step,
        loader,
        ctx,
        run,
        evaluator=evaluator_from(cfg, validate, "auc"),
        exporter=exporter,
        checkpointer=checkpointer,
        total=total,
    )


def train_local(cfg: PctrConfig, setup: Setup | None = None) -> dict:
    """Train in this process (CUDA when available and --device allows). Returns the final metrics.

    Checkpoints (every ``--ckpt-every`` steps and at the end) hold everything the next step depends on,
    so ``--resume`` continues exactly as if the run had not stopped."""
    st = setup or Setup(cfg)
    st.check_batch_size()
    run = RunDir(cfg.out)
    run.save_config(cfg)
    setup_logging(run)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    keep_freed_memory()
    step = make_local_step(cfg, st, device)
    if cfg.init_from and not (cfg.resume and run.has_checkpoint()):
        warm_start(step, st, cfg)
    a, b = st.bounds["train"]
    data = WorkerData(
        st.sources, st.encoder, a, b, cfg.batch_size, seed=cfg.seed, shuffle=cfg.shuffle, cache_device=device,
        cache_gb=cfg.cache_gb, cache_dir=run.path / "row-cache" / "worker-0",
    )  # fmt: skip
    val, val_labels = st.val_batches(device)
    total = st.total_steps(data.steps_per_epoch)
    log.info(
        "pctr %s: %d lines (train %s val %s), at most %d steps of %d on %s",
        cfg.model,
        st.lines,
        st.bounds["train"],
        st.bounds["val"],
        total,
        cfg.batch_size,
        device,
    )

    def validate(s: LocalStep) -> dict[str, float]:
        return auc_logloss(val_labels, predict_batches(s.model, val, s.client, device, idmap=s.idmap))

    validate = validate if len(val_labels) else None

    def export_now(metrics: dict, at_step: int) -> None:
        table, seen = step.table()
        export(run, st, step.model, table, seen, {"metrics": {**metrics, "step": at_step}})

    trainer = make_trainer(cfg, step, data, DistContext(device=device), run, validate, export_now, total)
    final = trainer.fit()
    tier = data.cache.tier
    data.close()  # the run is over: its row shards go (an interrupted run keeps them for --resume)
    skipped = {**st.val_stats.errors, **data.stats.errors}
    best = final.get("best_step", final["steps"])
    at_best = next(
        (h for h in trainer.history if h["step"] == best), trainer.history[-1] if trainer.history else {}
    )
    final.update(
        {
            "val_auc": at_best.get("eval_auc", float("nan")),
            "val_logloss": at_best.get("eval_logloss", float("nan")),
            "epochs": trainer.history,
            "skipped_lines": data.stats.skipped + st.val_stats.skipped,
            "skipped_examples": {str(k): v for k, v in sorted(skipped.items())[:10]},
            "mode": "single-process",
            "row_cache": tier,
            **({"ids": step.idmap.counters()} if step.idmap is not None else {}),
            "device": str(device),
            **({"image_features": dict(st.image.counts)} if st.image is not None else {}),
        }
    )
    run.write_final(final)
    return final
