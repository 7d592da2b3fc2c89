"""Training of the click models in one process (CPU or CUDA), on the one platform `Trainer`.

The step (`LocalStep`, built by `models.step`) pulls the unique rows of a batch from the local table, runs the model and
pushes exactly those rows' gradients to the row optimiser; dense parameters use a torch optimiser. The
parameter-server mode runs the same step math in `ps.py`.

Data: the run's input is one `data.reader.ClickSource` (``Setup.source``: files, schema, encoder, line count
and splits, each made once); epoch 1 streams the text, later epochs read its encoded rows (`WorkerData`;
apps/pctr/README.md, "Data larger than memory"). By default the model is evaluated on the validation split at the end of every epoch,
training stops once validation AUC has not improved for ``--early-stop`` evaluations (``--epochs`` is the
cap), and the best model is exported.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.evaluator import auc_logloss
from mariana.platform.core.export import export_model, load_init
from mariana.platform.core.prefetch import Prefetcher
from mariana.platform.core.rundir import RunDir, setup_logging
from mariana.platform.ps.protocol import TABLE
from mariana.platform.ps.pull import predict_batches
from mariana.platform.ps.shard import TableSpec
from mariana.platform.ps.worker_step import PullAheadLoader
from mariana.platform.runtime.dist import DistContext, resolve_device
from mariana.platform.sparse.local import LocalStep
from mariana.platform.sparse.rules import keep_freed_memory
from mariana.platform.train.spec import TrainSpec, build_trainer

from .configs import Ids, PctrConfig, PctrRun, Warm
from .data.encoding import Batch, ReadStats
from .data.reader import ClickSource, WorkerData
from .images.features import setup_image_features
from .models.nets import CTRModel
from .models.step import make_local_step

log = logging.getLogger("mariana")


# --------------------------------------------------------------------------- data
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
    """A run's pieces built once from its config: the input (``source``, a `ClickSource`: files, schema,
    encoder, line count and splits), the image features, the table's spec. ``source``: one already made
    from ``cfg`` (e.g. by the command line, which checks the input before processes start)."""

    def __init__(self, cfg: PctrConfig, source: ClickSource | None = None):
        self.cfg = cfg
        self.source = source or ClickSource.from_sections(cfg.input, cfg.rows)
        self.schema, self.encoder = self.source.schema, self.source.encoder
        self.idmap = None  # `--ids dynamic`: the trainer's `ids.idmap.IdMap` (set by LocalStep; exported)
        # `--image-features`: images.ImageFeatures; adds to schema.num_dense (and num_fields with
        # --image-cross), so before the table's spec
        self.image = None
        if getattr(cfg, "image_features", ""):
            self.image = setup_image_features(cfg.image, cfg.init_from, self.source)
        self.spec = TableSpec(
            TABLE, self.schema.num_rows, 1 + (0 if cfg.model == "lr" else cfg.dim), cfg.init_std
        )
        self.val_stats = ReadStats()

    def check_batch_size(self) -> None:
        """Every worker gets at least one full batch per epoch from the training split, or MarianaError."""
        self.source.sources.check_not_empty()
        a, b = self.source.bounds["train"]
        need = self.cfg.batch_size * max(1, self.cfg.workers if self.cfg.servers else 1)
        if b - a < need:
            per = f" x {self.cfg.workers} workers" if self.cfg.servers and self.cfg.workers > 1 else ""
            raise MarianaError(
                f"--batch-size {self.cfg.batch_size}{per} is larger than the training split of {self.cfg.data}: "
                f"{b - a} of its {self.source.lines} lines (--split {self.cfg.split}); use a smaller --batch-size"
            )

    def val_batches(self, device) -> tuple[list[Batch], np.ndarray]:
        """The validation split on ``device`` (`ClickSource.val_set`, at most ``--val-rows``) and its labels;
        its read statistics in ``val_stats``."""
        batches, labels, self.val_stats = self.source.val_set(device, self.cfg.val_rows)
        return batches, labels

    def worker_data(self, worker: int = 0, num_workers: int = 1, **cache) -> WorkerData:
        """This worker's share of the training split in batches of ``--batch-size`` (``cache``: the
        row cache's device, budget and folder)."""
        cfg = self.cfg
        return self.source.worker_data(
            cfg.batch_size,
            worker,
            num_workers,
            seed=cfg.seed,
            shuffle=cfg.shuffle,
            cache_gb=cfg.cache_gb,
            **cache,
        )

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
                **{k: cfg[k] for k in ("dim", "hidden", "cross_layers", "dropout")},
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
    kind = meta["model"]["kind"]
    export_model(
        run.path, sd, app="pctr", arch=kind, config=meta["config"], metrics=meta.get("metrics"), extra=meta
    )


def warm_start(step, run: PctrRun, rows: Ids, warm: Warm) -> None:
    """``run.init_from``: table rows, ``seen`` flags and dense weights of an earlier pctr model into ``step``;
    with ``--init-row-state`` also the table's row-optimiser state (Adagrad accumulators, FTRL z/n) from the
    source run's latest one-process checkpoint, with ``--init-train-state`` its whole training state."""
    state, meta = load_init(run.init_from, "pctr")
    table, seen = state.pop("table.weight", None), state.pop("seen", None)
    row_key = state.pop("idmap.row_key", None)
    if (row_key is not None) != (getattr(step, "idmap", None) is not None):
        raise MarianaError(
            f"--init-from {run.init_from}: it was trained with --ids {'dynamic' if row_key is not None else 'hash'}"
            f", this run has --ids {rows.ids}; rows mean different ids: use the same --ids"
        )
    live = step.model.table.weight.data
    if table is None or seen is None:
        raise MarianaError(f"--init-from {run.init_from}: the model lacks its embedding table")
    if tuple(table.shape) != tuple(live.shape):
        raise MarianaError(
            f"--init-from {run.init_from}: its table is {tuple(table.shape)} (rows, 1 + dim), this "
            f"configuration's is {tuple(live.shape)}; use the same --rows-per-field, --dim and fields"
        )
    try:
        step.model.load_dense_state_dict(state)
    except (RuntimeError, KeyError) as e:
        raise MarianaError(
            f"--init-from {run.init_from}: dense layers do not fit this model ({str(e).splitlines()[0]})"
        ) from None
    live.copy_(table)
    step.store.seen.copy_(seen.bool())
    if row_key is not None:  # the rows' ids (counts restart; --init-row-state below takes them too)
        try:
            step.idmap.load_rows(row_key.numpy())
        except ValueError as e:
            raise MarianaError(f"--init-from {run.init_from}: {e}") from None
    if warm.init_train_state:
        at = continue_training_state(step, run.init_from)
        log.info(
            "warm start from %s: its whole training state at step %d (weights, row and dense optimiser state; "
            "--init-train-state)",
            run.init_from,
            at,
        )
        return
    if warm.init_row_state:
        ck, src = _latest_checkpoint(run.init_from, "--init-row-state")
        try:
            step.load_row_state(ck["rows"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise MarianaError(f"--init-row-state: {src}: {str(e).splitlines()[0]}") from None
    log.info("warm start from %s (%s)", run.init_from, meta.get("version", "?"))


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


def continue_training_state(step, init_from: str) -> int:
    """``--init-from RUN --init-train-state`` (RUN: ``init_from``): load RUN's latest one-process checkpoint
    (model, table, row and dense optimiser state) into ``step`` (a `LocalStep`); hyper-parameters stay this
    run's. Returns the checkpoint's step. The weights come from the checkpoint, not RUN's export (an earlier, better-validated
    step): optimiser state only fits the weights it was accumulated with."""
    ck, src = _latest_checkpoint(init_from, "--init-train-state")
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


def batches(data: WorkerData, input, step) -> PctrLoader | PullAheadLoader:
    """This process's `PctrLoader`; a step that pulls rows ahead (parameter servers) wraps it."""
    loader = PctrLoader(data, input.prefetch)
    return PullAheadLoader(loader, step) if getattr(step, "pulls_ahead", False) else loader


SPEC = TrainSpec("pctr", "auc", loader=batches)  # its step, validation and export come from the mode


def make_trainer(cfg, step, data: WorkerData, ctx, run, validate, exporter, total: int, checkpointer=None):
    """The platform `Trainer` over this process's batches; ``validate`` is None without validation rows."""
    if validate is None and cfg.early_stop:
        # No validation rows (e.g. --split 1,0,0, a day of logs trained on in full): nothing to stop early
        # on, so the run makes its --epochs passes and exports the final model.
        log.info("no validation rows: no early stopping; the final model is exported")
        cfg = dataclasses.replace(cfg, early_stop=0)
    given = {"step": step, "data": data, "evaluate": validate, "exporter": exporter}
    return build_trainer(SPEC, cfg, ctx, run, given, checkpointer=checkpointer, total=total)


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
        warm_start(step, cfg.run, cfg.rows, cfg.warm)
    data = st.worker_data(cache_device=device, cache_dir=run.path / "row-cache" / "worker-0")
    val, val_labels = st.val_batches(device)
    total = st.total_steps(data.steps_per_epoch)
    log.info(
        "pctr %s: %d lines (train %s val %s), at most %d steps of %d on %s",
        cfg.model,
        st.source.lines,
        st.source.bounds["train"],
        st.source.bounds["val"],
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
