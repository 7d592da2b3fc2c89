"""Training of the click models: in one process (CPU or CUDA) or on the parameter-server framework.

Both modes run the same step on the same math: the unique rows of a batch are pulled (from a local shard
or from the servers), the model runs on them (`CTRModel.forward_rows`), and the gradient of exactly those
rows is pushed back and applied by the row optimiser; dense parameters use Adam (locally, or on server 0).

Data: the training split is streamed in row order in epoch 1 (parsed by a background thread one or more
batches ahead of the step) and kept, already encoded, in memory; later epochs read that cache (shuffled
batch order). Worker w of W takes global batches g with g % W == w.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import queue
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from mariana.platform.core.errors import DataError, MarianaError
from mariana.platform.core.export import export_model
from mariana.platform.core.loop import autocast_for
from mariana.platform.core.rundir import RunDir, setup_logging
from mariana.platform.ps.memory import keep_freed_memory
from mariana.platform.ps.shard import TableSpec

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
from .model import CTRModel, build_model
from .optim import build_dense, row_config

log = logging.getLogger("mariana")
TABLE = "table"


# --------------------------------------------------------------------------- data
class Prefetcher:
    """Run a generator in a background thread, ``depth`` items ahead (parsing overlaps the step)."""

    _END = object()

    def __init__(self, gen: Iterator, depth: int = 2):
        self.q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.err: BaseException | None = None
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, args=(gen,), daemon=True)
        self.t.start()

    def _run(self, gen):
        try:
            for item in gen:
                while not self.stop.is_set():
                    try:
                        self.q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self.stop.is_set():
                    return
        except BaseException as e:  # re-raised in the consumer
            self.err = e
        self.q.put(self._END)

    def __iter__(self):
        return self

    def __next__(self):
        item = self.q.get()
        if item is self._END:
            if self.err is not None:
                raise self.err
            raise StopIteration
        return item

    def close(self):
        self.stop.set()


class WorkerData:
    """Worker ``w`` of ``W``'s share of the training rows ``[start, stop)`` in batches of ``batch_size``.

    ``batches(epoch, skip)`` yields ``steps_per_epoch`` batches; epoch 0 streams the file (and fills the
    cache), later epochs come from the cache (on ``cache_device``)."""

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
    ):
        self.path, self.encoder, self.start, self.stop = path, encoder, start, stop
        self.bs, self.w, self.W, self.seed, self.shuffle = batch_size, worker, num_workers, seed, shuffle
        self.cache: list[Batch] = []
        self.cache_complete = False
        self.cache_device = torch.device(cache_device)
        self.stats = ReadStats()
        self.steps_per_epoch = max(1, ((stop - start) // batch_size) // num_workers)

    def _stream(self) -> Iterator[Batch]:
        chunks = iter_chunks(self.path, self.encoder, self.start, self.stop, stats=self.stats)
        for g, b in enumerate(iter_batches(chunks, self.bs, drop_last=True)):
            if g % self.W == self.w:
                b = b.to(self.cache_device)
                self.cache.append(b)
                yield b
        self.cache_complete = True
        if not self.cache:
            raise DataError(
                f"{self.path}: no valid rows for worker {self.w} in lines {self.start}-{self.stop}"
            )

    def batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        n = self.steps_per_epoch
        if epoch == 0 and not self.cache_complete:
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
        if not self.cache_complete:
            for _ in self._stream():
                pass
        order = np.arange(n) % len(self.cache)
        if self.shuffle:
            order = np.random.default_rng(self.seed * 1009 + epoch).permutation(order)
        for k in range(skip, n):
            yield self.cache[order[k]]


# --------------------------------------------------------------------------- one step
def gather_rows(client, ids: torch.Tensor, step: int, device, want_dense: bool = False):
    """Pull the unique rows of ``ids [B, F]``: (unique ids [U], inverse [B, F], rows leaf [U, K], dense)."""
    uniq, inv = torch.unique(ids, return_inverse=True)
    pulled, dense = client.pull({TABLE: uniq}, step, want_dense)
    rows = pulled[TABLE].to(device, non_blocking=True)
    return uniq, inv, rows, dense


def build_dense_only(cfg: PctrConfig, schema) -> CTRModel:
    """The model with a 1-row-per-field table stub, for processes whose rows live on parameter servers.
    Its dense layers start as in-process training's: they are created before the table (see CTRModel)."""
    return build_model(cfg, type(schema)(schema.format, schema.num_fields, 1, schema.num_dense))


def train_step(
    model: CTRModel,
    client,
    batch: Batch,
    step: int,
    device,
    dense_opt=None,
    remote_dense=False,
    autocast=None,
    clip_grad: float = 0.0,
):
    """One pull -> forward/backward -> push. Returns the mean log-loss (float tensor).

    ``clip_grad > 0`` scales the step's whole gradient (dense parameters and the batch's rows together)
    so that its L2 norm is at most ``clip_grad``.

    The batch's looked-up rows enter autograd as two leaves, ``w [B, F]`` and ``e [B, F, dim]``; their
    gradients are summed per unique row with one ``index_add_`` into ``[U, 1 + dim]`` (cheaper on CPU than
    the embedding backward over a ``[U, K]`` leaf). ``autocast`` (a context factory) wraps the forward."""
    uniq, inv, rows, dense_flat = gather_rows(client, batch.ids, step, device, want_dense=remote_dense)
    if remote_dense and dense_flat is not None:
        from mariana.platform.ps.dense import unflatten_into

        unflatten_into(dense_flat, model.dense_parameters())
    w = rows[:, 0][inv].requires_grad_(True)  # [B, F]
    e = F.embedding(inv, rows[:, 1:].contiguous()).requires_grad_(True)  # [B, F, dim]
    with autocast() if autocast is not None else contextlib.nullcontext():
        vals = None if bool((batch.vals == 1).all()) else batch.vals  # one-hot data: skip the products
        logits = model.forward_parts(w, e, vals, batch.dense)
    loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels)
    params = model.dense_parameters()
    for p in params:
        p.grad = None
    loss.backward()
    flat_inv = inv.reshape(-1)
    U = rows.shape[0]

    def per_row(g, width):  # [B, F(, d)] -> [U, width], summed over repeats (zeros if unused)
        if g is None:
            return rows.new_zeros(U, width)
        return rows.new_zeros(U, width).index_add_(0, flat_inv, g.reshape(flat_inv.numel(), width))

    row_grad = torch.cat([per_row(w.grad, 1), per_row(e.grad, rows.shape[1] - 1)], 1)
    if clip_grad > 0:
        clip_([row_grad, *(p.grad for p in params if p.grad is not None)], clip_grad)
    dense_grad = None
    if remote_dense:
        from mariana.platform.ps.dense import flatten

        dense_grad = flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in params]).cpu()
    client.push({TABLE: (uniq, row_grad)}, dense_grad, step)
    if dense_opt is not None:
        dense_opt.step()
    return loss.detach()


@torch.no_grad()
def clip_(grads: list[torch.Tensor], max_norm: float) -> None:
    """Scale ``grads`` in place so that their joint L2 norm is at most ``max_norm`` (as
    ``torch.nn.utils.clip_grad_norm_`` does for parameters)."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))


@torch.no_grad()
def predict_batches(model: CTRModel, batches, client, device, seen=None, rows_per_field=None) -> np.ndarray:
    """Probabilities for each batch (rows from ``client``; unseen rows -> OOV row if ``seen`` given)."""
    model.eval()
    out = []
    for b in batches:
        b = b.to(device)
        ids = b.ids
        if seen is not None:
            ids = torch.where(seen[ids], ids, ids - ids % rows_per_field)
        uniq, inv, rows, _ = gather_rows(client, ids, -1, device)
        out.append(torch.sigmoid(model.forward_rows(F.embedding(inv, rows), b.vals, b.dense)).float().cpu())
    model.train()
    return torch.cat(out).numpy() if out else np.zeros(0, dtype=np.float32)


def auc_logloss(labels: np.ndarray, probs: np.ndarray) -> dict[str, float]:
    from sklearn.metrics import log_loss, roc_auc_score

    if len(labels) == 0:
        return {"auc": float("nan"), "logloss": float("nan")}
    p = np.clip(probs.astype(np.float64), 1e-7, 1 - 1e-7)
    auc = float(roc_auc_score(labels, p)) if 0 < labels.sum() < len(labels) else float("nan")
    return {"auc": auc, "logloss": float(log_loss(labels, p, labels=[0, 1]))}


# --------------------------------------------------------------------------- shared set-up
class Setup:
    def __init__(self, cfg: PctrConfig):
        self.cfg = cfg
        self.schema = infer_schema(cfg.data, cfg.format, cfg.rows_per_field, cfg.num_fields)
        self.encoder = Encoder(self.schema)
        self.lines = count_lines(cfg.data)
        self.bounds = split_bounds(self.lines, parse_split(cfg.split))
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
        val = load_split(self.cfg.data, self.encoder, a, b, stats=self.val_stats)
        bs = 8192
        batches = [val.slice(i, i + bs).to(device) for i in range(0, len(val), bs)]
        return batches, val.labels.numpy()

    def total_steps(self, steps_per_epoch: int) -> int:
        return self.cfg.max_steps if self.cfg.max_steps > 0 else self.cfg.epochs * steps_per_epoch

    def meta(self, extra: dict | None = None) -> dict:
        import dataclasses

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
            "version": time.strftime("%Y%m%d-%H%M%S") + f"-{self.cfg.model}",
            **(extra or {}),
        }


def export(run: RunDir, setup: Setup, model: CTRModel, table: torch.Tensor, seen: torch.Tensor, extra=None):
    sd = {k: v for k, v in model.state_dict().items() if k != "table.weight"}
    sd["table.weight"] = table
    sd["seen"] = seen.to(torch.uint8)
    export_model(run.path, sd, setup.meta(extra))


def _counter(run: RunDir, worker: int, rec: dict) -> None:
    d = run.path / "counters"
    d.mkdir(exist_ok=True)
    with open(d / f"worker-{worker}.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


# --------------------------------------------------------------------------- single process
def _local_state(model, dense_opt, sched, shard, progress: dict) -> dict:
    """A one-process checkpoint: the model (its ``table.weight`` is the table itself), the dense optimiser
    and schedule, the table's row-optimiser state and ``seen`` flags, and ``progress`` (step, data position,
    validation history, counters). Tensors, containers and numbers only (``weights_only`` loadable)."""
    return {
        "model": model.state_dict(),
        "dense_opt": dense_opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rows": {"state": dict(shard.state[TABLE]), "seen": shard.seen[TABLE]},
        **progress,
    }


def _load_local_state(state: dict, model, dense_opt, sched, shard, where) -> None:
    """Copy a `_local_state` checkpoint into the live objects (in place: the shard and the model share
    the table tensor). MarianaError naming the checkpoint if it does not fit this model."""
    try:
        model.load_state_dict(state["model"])
        dense_opt.load_state_dict(state["dense_opt"])
        sched.load_state_dict(state["scheduler"])
        live = shard.state[TABLE]
        if sorted(live) != sorted(state["rows"]["state"]):
            raise ValueError(f"row optimiser state {sorted(state['rows']['state'])}, expected {sorted(live)}")
        for k, v in state["rows"]["state"].items():
            live[k].copy_(v)
        shard.seen[TABLE].copy_(state["rows"]["seen"])
    except (KeyError, RuntimeError, ValueError) as e:
        raise MarianaError(
            f"checkpoint in {where} does not fit this model: {str(e).splitlines()[0]}"
        ) from None


def train_local(cfg: PctrConfig, setup: Setup | None = None) -> dict:
    """Train in this process (CUDA when available and --device allows). Returns the final metrics.

    Checkpoints (every ``--ckpt-every`` steps and at the end) hold everything the next step depends on,
    so ``--resume`` continues exactly as if the run had not stopped."""
    from dataclasses import replace

    from mariana.platform.core.checkpoint import load_checkpoint, save_checkpoint, set_rng_state
    from mariana.platform.core.faults import FaultInjector
    from mariana.platform.core.optim import build_scheduler, lr_factor
    from mariana.platform.dp.dist import resolve_device
    from mariana.platform.ps.shard import EmbeddingShard
    from mariana.platform.ps.worker import LocalClient
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    st = setup or Setup(cfg)
    st.check_batch_size()
    run = RunDir(cfg.out)
    run.save_config(cfg)
    setup_logging(run)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    keep_freed_memory()
    amp = functools.partial(autocast_for, cfg, device)  # --amp: bf16 autocast of the dense layers
    from mariana.platform.ps.shard import init_rows

    model = build_model(cfg, st.schema, table=init_rows(st.spec, cfg.seed))
    model.to(device)
    rows_opt = row_config(cfg)
    shard = EmbeddingShard([st.spec], 0, 1, rows_opt, cfg.seed, device, {TABLE: model.table.weight.data})
    client = LocalClient(shard)
    dense_opt = build_dense(cfg, model.dense_parameters())
    a, b = st.bounds["train"]
    data = WorkerData(
        cfg.data, st.encoder, a, b, cfg.batch_size, seed=cfg.seed, shuffle=cfg.shuffle, cache_device=device
    )
    val, val_labels = st.val_batches(device)
    spe = data.steps_per_epoch
    total = st.total_steps(spe)
    sched = build_scheduler(cfg, dense_opt, total)
    # where the next step's batch is: epoch, batch index in it (== spe: the epoch's batches are done but
    # its validation report is not)
    step, epoch, pos, history, seen_n, loss_acc = 0, 0, 0, [], 0, [0.0, 0]
    if cfg.resume and run.has_checkpoint():
        state, rng = load_checkpoint(run)
        _load_local_state(state, model, dense_opt, sched, shard, run.ckpt_dir)
        step, epoch, pos = state["step"], state["data"]["epoch"], state["data"]["batch"]
        history, seen_n, loss_acc = list(state["history"]), state["samples"], list(state["loss"])
        if rng is not None:
            set_rng_state(rng)
        log.info("resumed from step %d (epoch %d, batch %d)", step, epoch, pos)
    log.info(
        "pctr %s: %d lines (train %s val %s), %d steps of %d on %s",
        cfg.model,
        st.lines,
        st.bounds["train"],
        st.bounds["val"],
        total,
        cfg.batch_size,
        device,
    )

    def save():
        progress = {
            "step": step,
            "data": {"epoch": epoch, "batch": pos},
            "history": history,
            "samples": seen_n,
            "loss": [float(loss_sum), loss_n],
        }
        state = _local_state(model, dense_opt, sched, shard, progress)
        save_checkpoint(run, step, state, 0, lambda: None)
        log.debug("checkpoint at step %d written to %s", step, run.ckpt_dir)

    def validate() -> dict[str, float]:
        return auc_logloss(val_labels, predict_batches(model, val, client, device))

    faults = FaultInjector()  # MARIANA_FAULT=kill:rank=0:step=S (tests)
    bar = tqdm(
        total=total,
        initial=step,
        disable=not (cfg.progress and sys.stderr.isatty()),
        desc="train",
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0,
        file=sys.stderr,
    )
    t0, start_seen = time.perf_counter(), seen_n
    loss_sum, loss_n = torch.full((), loss_acc[0], device=device), int(loss_acc[1])
    redirect = logging_redirect_tqdm([log]) if not bar.disable else contextlib.nullcontext()
    # console log lines print above the bar, not through it
    with redirect, bar:
        while step < total:
            gen = data.batches(epoch, pos)
            it = Prefetcher(gen, cfg.prefetch) if epoch == 0 and cfg.prefetch > 0 else gen
            te, ne = time.perf_counter(), 0  # this epoch's training time and samples (validation excluded)
            try:
                for batch in it:
                    if step >= total:
                        break
                    faults.maybe_fire(step + 1)
                    # the table's learning rate follows the same warm-up and schedule as the dense one
                    shard.opt = replace(
                        rows_opt, lr=cfg.sparse_lr * lr_factor(step, total, cfg.warmup_steps, cfg.schedule)
                    )
                    batch = batch.to(device)
                    loss_sum += train_step(
                        model, client, batch, step, device, dense_opt, autocast=amp, clip_grad=cfg.clip_grad
                    )
                    lrs = dense_opt.param_groups[0]["lr"], shard.opt.lr  # the rates this step used
                    sched.step()
                    loss_n += 1
                    seen_n += len(batch)
                    ne += len(batch)
                    step += 1
                    pos += 1
                    bar.update(1)
                    if step % cfg.log_every == 0 or step == total:
                        loss = float(loss_sum) / max(1, loss_n)
                        rec = {
                            "step": step,
                            "epoch": epoch,
                            "loss": loss,
                            "samples_per_s": (seen_n - start_seen) / (time.perf_counter() - t0),
                            "lr": lrs[0],
                            "sparse_lr": lrs[1],
                        }
                        run.log_metrics(rec)
                        bar.set_postfix(loss=f"{loss:.4f}")
                        loss_sum.zero_()
                        loss_n = 0
                    if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                        m = validate()
                        run.log_metrics(
                            {"step": step, "epoch": epoch, "eval_auc": m["auc"], "eval_logloss": m["logloss"]}
                        )
                        log.info("step %d: val AUC %.4f logloss %.4f", step, m["auc"], m["logloss"])
                    if cfg.ckpt_every and step % cfg.ckpt_every == 0 and step < total:
                        save()
            finally:
                if isinstance(it, Prefetcher):
                    it.close()
            rate = ne / max(1e-9, time.perf_counter() - te)
            m = validate()
            history.append(
                {
                    "epoch": epoch,
                    "step": step,
                    "val_auc": m["auc"],
                    "val_logloss": m["logloss"],
                    "train_samples_per_s": rate,
                }
            )
            log.info(
                "epoch %d: val AUC %.4f logloss %.4f (%.0f samples/s%s)",
                epoch,
                m["auc"],
                m["logloss"],
                rate,
                ", parsing the text" if epoch == 0 else ", from the in-memory cache",
            )
            _counter(
                run,
                0,
                {
                    "step": step,
                    "epoch": epoch,
                    "val_auc": m["auc"],
                    "val_logloss": m["logloss"],
                    "samples_per_s": (seen_n - start_seen) / max(1e-9, time.perf_counter() - t0),
                    "attempt": 0,
                },
            )
            if pos >= spe:
                epoch, pos = epoch + 1, 0
    wall = time.perf_counter() - t0
    if not history:  # resumed at or past --max-steps before any report
        m = validate()
        history.append({"epoch": epoch, "step": step, "val_auc": m["auc"], "val_logloss": m["logloss"]})
    save()
    skipped = {**st.val_stats.errors, **data.stats.errors}
    final = {
        "val_auc": history[-1]["val_auc"],
        "val_logloss": history[-1]["val_logloss"],
        "steps": step,
        "samples": seen_n,
        "samples_per_s": (seen_n - start_seen) / wall if wall > 0 else 0.0,
        "wall_s": wall,
        "epochs": history,
        "skipped_lines": data.stats.skipped + st.val_stats.skipped,
        "skipped_examples": {str(k): v for k, v in sorted(skipped.items())[:10]},
        "mode": "single-process",
        "device": str(device),
    }
    export(
        run, st, model, model.table.weight.data, shard.seen[TABLE], {"metrics": {"val_auc": final["val_auc"]}}
    )
    run.write_final(final)
    return final


# --------------------------------------------------------------------------- parameter-server processes
def run_ps_process(cfg: PctrConfig) -> int:
    """Body of one torchrun process of a parameter-server job (role from RANK)."""
    from mariana.platform.ps.runtime import role_from_env, rpc_session

    role = role_from_env(cfg.servers, cfg.workers)
    keep_freed_memory()
    run = RunDir(cfg.out)
    setup_logging(run, rank=role.rank)
    torch.set_num_threads(1)
    if role.kind == "server":
        return _serve(cfg, role, run, rpc_session)
    return _work(cfg, role, run, rpc_session)


def _serve(cfg, role, run, rpc_session) -> int:
    from mariana.platform.ps.dense import DenseStore, flatten
    from mariana.platform.ps.faults import Fault
    from mariana.platform.ps.server import ParamServer, install
    from mariana.platform.ps.shard import EmbeddingShard

    st = Setup(cfg)
    shard = EmbeddingShard([st.spec], role.index, role.num_servers, row_config(cfg), cfg.seed)
    dense = None
    if role.index == 0:
        torch.manual_seed(cfg.seed)
        m = build_dense_only(cfg, st.schema)  # the same dense initialisation as in-process training
        dense = DenseStore(flatten(m.dense_parameters()), cfg.optimizer, cfg.lr)
        del m
    server = ParamServer(
        role.index, role.num_servers, role.num_workers, shard, dense, cfg.staleness, run.ckpt_dir
    )
    restored = server.restore_latest()
    if restored is not None:
        log.info(
            "server %d: restored shard from checkpoint step %d (attempt %d)",
            role.index,
            restored,
            role.attempt,
        )
    fault = Fault("server", role.index, "push")
    if fault.at:
        orig = server.push

        def push(*a, **k):
            fault.maybe_fire(server.counters["pushes"] + 1)
            return orig(*a, **k)

        server.push = push
    install(server)
    with rpc_session(role, cfg.timeout):
        server.serve()
    (run.path / "counters").mkdir(exist_ok=True)
    (run.path / "counters" / f"server-{role.index}.json").write_text(
        json.dumps({**server.counters, "restored_from": restored, "attempt": role.attempt}) + "\n"
    )
    return 0


def _work(cfg, role, run, rpc_session) -> int:
    from mariana.platform.ps.faults import Fault
    from mariana.platform.ps.worker import PSClient

    st = Setup(cfg)
    torch.manual_seed(cfg.seed)
    cpu = torch.device("cpu")
    amp = functools.partial(autocast_for, cfg, cpu)
    model = build_dense_only(cfg, st.schema)  # rows come from the servers
    a, b = st.bounds["train"]
    data = WorkerData(
        cfg.data, st.encoder, a, b, cfg.batch_size, role.index, role.num_workers, cfg.seed, cfg.shuffle
    )
    total = st.total_steps(data.steps_per_epoch)
    val, val_labels = st.val_batches(cpu)
    fault = Fault("worker", role.index, "step")
    with rpc_session(role, cfg.timeout):
        client = PSClient(role.num_servers, role.index, cfg.staleness, cfg.timeout)
        step = client.resume_step()
        if step > 0:
            log.info("worker %d: resuming at step %d (attempt %d)", role.index, step, role.attempt)
        t0, n0, loss_sum, loss_n = time.perf_counter(), 0, 0.0, 0
        spe = data.steps_per_epoch
        while step < total:
            epoch, skip = divmod(step, spe)
            gen = data.batches(epoch, skip)
            it = Prefetcher(gen, cfg.prefetch) if epoch == 0 else gen
            for batch in it:
                if step >= total:
                    break
                fault.maybe_fire(step)
                loss_sum += float(
                    train_step(
                        model,
                        client,
                        batch,
                        step,
                        cpu,
                        remote_dense=True,
                        autocast=amp,
                        clip_grad=cfg.clip_grad,
                    )
                )
                loss_n += 1
                n0 += len(batch)
                step += 1
                if role.index == 0 and cfg.ckpt_every and step % cfg.ckpt_every == 0 and step < total:
                    client.checkpoint(step)
                if step % cfg.log_every == 0:
                    dt = time.perf_counter() - t0
                    _counter(
                        run,
                        role.index,
                        {
                            "step": step,
                            "epoch": epoch,
                            "loss": loss_sum / max(1, loss_n),
                            "samples_per_s": n0 / dt,
                            "pull_s": client.pull_s,
                            "push_wait_s": client.push_wait_s,
                            "attempt": role.attempt,
                        },
                    )
                    loss_sum, loss_n = 0.0, 0
            if isinstance(it, Prefetcher):
                it.close()
            if step % spe == 0 or step >= total:
                client.wait()
                _, dense_flat = client.pull({TABLE: torch.zeros(0, dtype=torch.int64)}, -1, True)
                from mariana.platform.ps.dense import unflatten_into

                unflatten_into(dense_flat, model.dense_parameters())
                m = auc_logloss(val_labels, predict_batches(model, val, client, cpu))
                _counter(
                    run,
                    role.index,
                    {
                        "step": step,
                        "epoch": epoch,
                        "val_auc": m["auc"],
                        "val_logloss": m["logloss"],
                        "samples_per_s": n0 / (time.perf_counter() - t0),
                        "attempt": role.attempt,
                    },
                )
        client.done()
        if role.index == 0:
            client.wait_all_done()
            client.checkpoint(total)
            tables, dense_flat = client.dump({TABLE: st.spec.num_rows})
            from mariana.platform.ps.dense import unflatten_into

            unflatten_into(dense_flat, model.dense_parameters())
            weight, seen = tables[TABLE]
            full = build_model(cfg, st.schema, table=weight)
            full.load_dense_state_dict(model.state_dict())
            m = auc_logloss(val_labels, predict_batches(full, val, _TableClient(weight), cpu))
            wall = time.perf_counter() - t0
            final = {
                "val_auc": m["auc"],
                "val_logloss": m["logloss"],
                "steps": total,
                "mode": "parameter-server",
                "servers": role.num_servers,
                "workers": role.num_workers,
                "staleness": cfg.staleness,
                "worker0_samples_per_s": n0 / wall,
                "skipped_lines": data.stats.skipped,
                "skipped_examples": {str(k): v for k, v in list(data.stats.errors.items())[:10]},
                "server_counters": client.server_counters,
            }
            export(run, st, full, weight, seen, {"metrics": {"val_auc": m["auc"]}})
            run.write_final(final)
            client.finish_servers()
    return 0


class _TableClient:
    """Pull from a full in-memory table (used to score the assembled model)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def pull(self, reqs, step=-1, want_dense=False):
        return {n: self.weight.index_select(0, r) for n, r in reqs.items()}, None
