"""The one training loop every job runs on (its components: platform/README.md, One training loop).

The loop itself only counts: optimizer steps, the data position ``(epoch, batch)``, when to log,
evaluate, checkpoint and stop. With ``cfg.resume`` (or when torchrun restarts the worker group) it
continues exactly from the last checkpoint (step state, data position, the evaluator's best value, every
rank's RNG states); with a monitored metric the exported model is the best evaluated one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .checkpoint import load_checkpoint, save_checkpoint, set_rng_state
from .config import TrainConfig
from .errors import MarianaError
from .evaluator import Evaluator
from .faults import FaultInjector
from .hostreads import from_env as host_read_audit
from .rundir import RunDir
from .steps import TrainStep, autocast_for, move_to, unwrap  # noqa: F401  (re-exported)
from .tracking import attach as attach_tracker

log = logging.getLogger("mariana")

Exporter = Callable[[dict[str, float], int], None]
PREEMPTED_EXIT = 75  # checkpointed at a preemption signal (EX_TEMPFAIL): the Slurm batch script requeues


class BatchLoader(Protocol):
    """A resumable source of batches for one rank."""

    batches_per_epoch: int

    def iterate(self, epoch: int, start: int) -> Iterator[Any]:
        """This rank's batches of ``epoch`` from batch index ``start`` on (deterministic per epoch)."""
        ...


def total_steps(cfg: TrainConfig, batches_per_epoch: int) -> int:
    """Optimizer steps of the run: ``--max-steps``, or ``--epochs`` x full accumulation groups per epoch.
    MarianaError if one epoch has no complete optimizer step (too little data for the batch size)."""
    accum = getattr(cfg, "grad_accum", 1)
    if batches_per_epoch < accum:
        raise MarianaError(
            f"one epoch has {batches_per_epoch} batches per worker, fewer than --grad-accum {accum}: "
            f"the training data is too small for --batch-size {cfg.batch_size} x --workers {cfg.workers}; "
            "use a smaller --batch-size or fewer --workers"
        )
    return cfg.max_steps or cfg.epochs * (batches_per_epoch // accum)


class Checkpointer:
    """Writes and reads ``RUN/checkpoints/step_N``: the Trainer's progress and the step's state in
    ``state.pt`` (rank 0), extra files the step writes itself, every rank's RNG state; ``latest`` moves
    only once all ranks wrote (`save_checkpoint`)."""

    def __init__(self, run: RunDir, ctx, keep: int = 2):
        self.run, self.ctx, self.keep = run, ctx, keep

    def save(self, step: TrainStep, progress: dict[str, Any]) -> None:
        n = progress["step"]
        folder = self.run.ckpt_dir / f"step_{n:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        state = step.checkpoint_state(folder)
        payload = {**state, **progress} if self.ctx.is_main else None
        save_checkpoint(self.run, n, payload, self.ctx.rank, self.ctx.barrier, self.keep)
        if self.ctx.is_main:
            log.debug("checkpoint at step %d written to %s", n, self.run.ckpt_dir)

    def load(self, step: TrainStep) -> dict[str, Any]:
        state, rng = load_checkpoint(self.run, self.ctx.rank)
        folder = self.run.ckpt_dir / (self.run.ckpt_dir / "latest").read_text().strip()
        step.restore(state, folder)
        if rng is not None:
            set_rng_state(rng)
        return state


class MetricsLogger:
    """``metrics.jsonl`` records (rank 0) and the progress bar; train records carry loss, samples/s,
    step time, communication time and bytes, learning rate(s)."""

    def __init__(self, run: RunDir, ctx, total: int, initial: int, enabled: bool, desc: str):
        self.run, self.ctx = run, ctx
        # a worker's stderr is a pipe that the launcher shows on the terminal (rank 0 only); one process
        # draws the bar only on a terminal (no bar frames in job-service logs or captured output)
        visible = sys.stderr.isatty() or os.environ.get("MARIANA_CONSOLE_TTY") == "1"  # set by the launcher
        on_tty_or_forced = enabled and ctx.is_main and visible
        self.bar = tqdm(
            total=total,
            initial=initial,
            disable=not on_tty_or_forced,
            desc=desc,
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0,
            file=sys.stderr,
        )
        # the interval's loss sum (on the device: no host read per step), samples, steps, input wait; the
        # run's samples logged so far and the last logged loss
        self.loss_sum = torch.zeros((), device=ctx.device)
        self.interval_samples, self.interval_steps, self.interval_wait = 0, 0, 0.0
        self.last_log = time.perf_counter()
        self.run_samples, self.last_loss = 0, float("nan")

    def add(self, loss: torch.Tensor, samples: int, wait_s: float) -> None:
        """One optimizer step: its loss [], samples, seconds waited for its input."""
        self.loss_sum += loss
        self.interval_samples += samples
        self.interval_steps += 1
        self.interval_wait += wait_s
        self.bar.update(1)

    def log_train(self, step: int, epoch: int, step_obj: TrainStep) -> None:
        """Write the interval's train record (mean loss, samples/s, step, communication and input-wait
        times, learning rates) and start the next interval."""
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        n = self.interval_steps
        self.last_loss = step_obj.mean_loss(self.loss_sum, n)
        samples = self.interval_samples * step_obj.data_parallel
        self.run_samples += samples
        comm_s, comm_bytes = step_obj.comm_stats()
        record = {
            "step": step,
            "epoch": epoch,
            "loss": self.last_loss,
            "samples_per_s": samples / max(1e-9, now - self.last_log),
            "step_time_s": (now - self.last_log) / n,
            "comm_time_s": comm_s / n,
            "data_wait_s": self.interval_wait / n,
            "comm_bytes": comm_bytes // n,
            **step_obj.lrs(),
        }
        self.write(record)
        self.bar.set_postfix(loss=f"{self.last_loss:.4f}", sps=f"{record['samples_per_s']:.0f}")
        self.loss_sum.zero_()
        self.interval_samples, self.interval_steps, self.interval_wait = 0, 0, 0.0
        self.last_log = time.perf_counter()

    def flush(self, step_obj: TrainStep) -> None:
        """Count the steps not logged yet (an early stop between log points) in the last loss and samples."""
        if self.interval_steps:
            self.last_loss = step_obj.mean_loss(self.loss_sum, self.interval_steps)
            self.run_samples += self.interval_samples * step_obj.data_parallel

    def write(self, record: dict[str, Any]) -> None:
        if self.ctx.is_main:
            self.run.log_metrics(record)

    def redirect(self):
        """Console log lines print above the bar, not through it."""
        return logging_redirect_tqdm([log]) if not self.bar.disable else contextlib.nullcontext()


class Trainer:
    """Runs ``step`` over ``loader`` until ``--max-steps``/``--epochs`` or early stopping.

    ``evaluator``: when to evaluate, the monitored metric, patience; ``exporter(metrics, step)`` writes the
    model (called on every rank; the app decides which rank writes); ``checkpointer``: default
    `Checkpointer` (the parameter-server step brings one that checkpoints the servers). ``MARIANA_FAULT``'s
    ``step=N`` faults fire before each step (`faults.FaultInjector`). `fit` runs the whole schedule;
    `train_now` trains on a given loader's batches at once (a stream, file by file)."""

    def __init__(
        self,
        cfg: TrainConfig,
        step: TrainStep,
        loader: BatchLoader,
        ctx,
        run: RunDir,
        evaluator: Evaluator | None = None,
        exporter: Exporter | None = None,
        checkpointer: Checkpointer | None = None,
        desc: str = "train",
        total: int | None = None,
    ):
        self.cfg, self.step_obj, self.loader, self.ctx, self.run = cfg, step, loader, ctx, run
        self.evaluator, self.exporter, self.desc = evaluator, exporter, desc
        self.checkpointer = checkpointer or Checkpointer(run, ctx)
        self.total_steps = total if total is not None else total_steps(cfg, loader.batches_per_epoch)
        self.accum = getattr(cfg, "grad_accum", 1)
        step.setup(self.total_steps)
        self.step, self.epoch, self.pos, self.samples = 0, 0, 0, 0
        self.history: list[dict[str, Any]] = []
        self.exported_step = -1
        self.faults = FaultInjector()
        self.logger: MetricsLogger | None = None
        self.signalled: str | None = None  # the preemption signal received (`_arm`)
        self._armed = False
        if ctx.watchdog is not None:
            ctx.watchdog.report_dir = run.log_dir
        attach_tracker(cfg, run, ctx)  # MLflow / TensorBoard on rank 0 when asked for (fed by `run`)

    # --- checkpoints -----------------------------------------------------------------------------------
    def progress(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "data": {"epoch": self.epoch, "batch": self.pos},
            "trainer": {
                "samples": self.samples,
                "history": self.history,
                "exported_step": self.exported_step,
                "evaluator": self.evaluator.state_dict() if self.evaluator else None,
            },
        }

    def save(self) -> None:
        self.ctx.set_phase("checkpoint")
        self.checkpointer.save(self.step_obj, self.progress())

    def maybe_resume(self) -> bool:
        restarted = any(
            int(os.environ.get(v, "0")) > 0 for v in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
        )
        if getattr(self.checkpointer, "resume_from_servers", False):
            state = self.checkpointer.load(self.step_obj)  # the servers know where to continue
            if state is None:
                return False
        elif not (self.cfg.resume or restarted):
            return False
        elif not self.run.has_checkpoint():
            if self.cfg.resume and not restarted:
                raise MarianaError(f"--resume: no checkpoint in {self.run.ckpt_dir}")
            return False  # restarted before the first checkpoint: start over
        else:
            state = self.checkpointer.load(self.step_obj)
        self.step, self.epoch, self.pos = state["step"], state["data"]["epoch"], state["data"]["batch"]
        if self.cfg.resume and not restarted and self.step >= self.total_steps:  # would train nothing
            raise MarianaError(
                f"--resume: the run has already done {self.step} steps and this --max-steps/--epochs allows "
                f"{self.total_steps}; pass a larger --max-steps or --epochs to train further"
            )
        t = state.get("trainer") or {}
        self.samples, self.history = int(t.get("samples", 0)), list(t.get("history", []))
        self.exported_step = int(t.get("exported_step", -1))
        if self.evaluator is not None and t.get("evaluator"):
            self.evaluator.load_state_dict(t["evaluator"])
        if self.ctx.is_main:
            self.run.drop_metrics_after(self.step)  # the steps after the checkpoint are done again
            log.info(
                "resumed from step %d (epoch %d, batch %d)%s",
                self.step,
                self.epoch,
                self.pos,
                " after a restart (torchrun's or a Slurm requeue)" if restarted else "",
            )
        return True

    def batch_epoch(self) -> int:
        """The epoch of the last batch taken (at an epoch boundary: the epoch that just ended)."""
        return self.epoch - 1 if (self.pos == 0 and self.step > 0) else self.epoch

    # --- evaluation ------------------------------------------------------------------------------------
    def evaluate(self, reason: str) -> dict[str, float]:
        """Run the evaluator now, log ``eval_*`` records, export on a new best; returns the metrics."""
        ev = self.evaluator
        if ev is None:
            return {}
        if self.ctx.watchdog is not None:
            self.ctx.watchdog.disarm()  # evaluation has no collectives of the step's kind and may be long
        self.ctx.set_phase("eval")
        metrics = {
            k: v if type(v) is int else float(v) for k, v in self.step_obj.evaluate(ev.fn).items()
        }  # counts stay int
        best = ev.record(self.step, metrics)
        best = self._agree(best)
        record = {
            "step": self.step,
            "epoch": self.batch_epoch(),
            **{f"eval_{k}": v for k, v in metrics.items()},
        }
        self.history.append(record)
        self.logger.write(record)
        if self.ctx.is_main:
            shown = " ".join(f"{k} {v}" if isinstance(v, int) else f"{k} {v:.4f}" for k, v in metrics.items())
            log.info(
                "step %d (%s): eval %s%s", self.step, reason, shown, " (best)" if best and ev.monitor else ""
            )
        if best and ev.monitor and self.exporter is not None:
            self.exporter({f"eval_{k}": v for k, v in metrics.items()}, self.step)
            self.exported_step = self.step
        return metrics

    def _agree(self, flag: bool, any_rank: bool = False) -> bool:
        """Rank 0's decision on every rank (evaluations may differ in the last bits between ranks), or with
        ``any_rank`` whether any rank's ``flag`` is set."""
        if not self.ctx.distributed:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX) if any_rank else dist.broadcast(t, 0)
        return bool(t.item())

    # --- the loop --------------------------------------------------------------------------------------
    def _batches(self) -> Iterator[Any]:
        """The data stream from the current position on; advances ``epoch``/``pos``."""
        while True:
            it = iter(self.loader.iterate(self.epoch, self.pos))
            try:
                for batch in it:
                    self.pos += 1
                    yield batch
                    if self.pos >= self.loader.batches_per_epoch:
                        break
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()  # e.g. a prefetching thread
            self.epoch, self.pos = self.epoch + 1, 0

    def fit(self) -> dict[str, Any]:
        """Train until ``--max-steps``/``--epochs`` or early stopping (resuming first when asked);
        evaluate, checkpoint and export on schedule; write ``metrics.json``. Returns its record."""
        handlers = self._arm()
        try:
            return self._fit()
        finally:  # a signal after the loop (the final evaluation and export) is noted, the run ends as usual
            for sig, old in (handlers or {}).items():
                signal.signal(sig, old)

    def _fit(self) -> dict[str, Any]:
        cfg, ctx = self.cfg, self.ctx
        resumed = self.maybe_resume()
        self.logger = MetricsLogger(self.run, ctx, self.total_steps, self.step, cfg.progress, self.desc)
        start_time, start_step = time.perf_counter(), self.step
        eval_metrics: dict[str, float] = {}
        with self.logger.redirect(), self.logger.bar:
            if self.evaluator is not None and not resumed and getattr(cfg, "init_from", ""):
                eval_metrics = self.evaluate("warm start")  # the starting point, for comparison
            stopped_early, eval_metrics = self._run(eval_metrics, scheduled=True)
            wall = time.perf_counter() - start_time
            self.logger.flush(self.step_obj)  # a loss not yet logged (early stop between log points)
            self.samples += self.logger.run_samples
            if self.evaluator is not None and self.evaluator.last_step != self.step:
                eval_metrics = self.evaluate("end")
            elif self.evaluator is not None and self.history:
                eval_metrics = {k[5:]: v for k, v in self.history[-1].items() if k.startswith("eval_")}
            self.save()
        self._export_final(eval_metrics)
        final = {
            "steps": self.step,
            "epochs_completed": self.epoch,
            "train_loss": self.logger.last_loss,
            "samples_per_s": self.logger.run_samples / wall if wall > 0 and self.step > start_step else 0.0,
            "wall_time_s": wall,
            "world_size": ctx.world_size,
            "stopped_early": stopped_early,
            "exported_step": self.exported_step,
            **{f"eval_{k}": v for k, v in eval_metrics.items()},
            **(self.evaluator.summary() if self.evaluator else {}),
        }
        if ctx.is_main:
            self.run.write_final(final)
        if ctx.watchdog is not None:
            ctx.watchdog.disarm()
        return final

    def train_now(self, loader: BatchLoader, start_step: int | None = None) -> int:
        """Train on one pass of ``loader``'s batches now (a stream: one call per file, with one Trainer
        for the whole stream). The step count goes on from ``start_step`` (default: where the last call
        ended); train records go to ``metrics.jsonl`` with that global step, and ``MARIANA_FAULT``'s step
        faults fire as in `fit`. Nothing is evaluated, checkpointed or exported and no ``metrics.json`` is
        written: the caller does those on its own schedule. Returns the optimizer steps taken."""
        if start_step is not None:
            self.step = start_step
        start = self.step
        self.loader, self.epoch, self.pos = loader, 0, 0
        self.total_steps = start + loader.batches_per_epoch // self.accum
        self.step_obj.setup(self.total_steps)
        self.logger = MetricsLogger(self.run, self.ctx, self.total_steps, start, self.cfg.progress, self.desc)
        with self.logger.redirect(), self.logger.bar:
            self._run({}, scheduled=False)
            self.logger.flush(self.step_obj)
        self.samples += self.logger.run_samples
        return self.step - start

    def _run(self, eval_metrics: dict[str, float], scheduled: bool) -> tuple[bool, dict[str, float]]:
        """The steps up to ``total_steps`` (or an early stop); ``scheduled``: evaluate and checkpoint on
        the schedule of ``cfg``. Returns (stopped early, the latest evaluation's metrics)."""
        ctx, stream, stopped_early = self.ctx, self._batches(), False
        audit = host_read_audit(ctx.rank)  # MARIANA_AUDIT_HOST_READS: count host reads per step
        while self.step < self.total_steps and not stopped_early:
            self.faults.maybe_fire(self.step + 1)
            ctx.beat(self.step + 1, "data")
            epoch_before = self.epoch
            t_data = time.perf_counter()
            micro = [next(stream) for _ in range(self.accum)]
            wait = time.perf_counter() - t_data  # the step waiting for input
            if audit is not None:
                audit.begin()
                audit.__enter__()
            loss, n = self.step_obj.train_step(micro)
            self.step += 1
            self.logger.add(loss, n, wait)
            # the epoch ended when the last batch taken was its last one
            epoch_ended = self.pos >= self.loader.batches_per_epoch or self.epoch > epoch_before
            if self.pos >= self.loader.batches_per_epoch:
                self.epoch, self.pos = self.epoch + 1, 0
                stream.close()
                stream = self._batches()
            logged = self.step % self.cfg.log_every == 0 or self.step == self.total_steps
            if logged:
                self.logger.log_train(self.step, self.batch_epoch(), self.step_obj)
            evaluated = saved = False
            if scheduled:
                evaluated, stopped_early, eval_metrics = self._maybe_evaluate(epoch_ended, eval_metrics)
                saved = self._maybe_save()
            if audit is not None:
                audit.__exit__(None, None, None)
                audit.end(self.step, logged, evaluated, saved)
            if scheduled and self._armed:
                self._maybe_preempt(stream, logged)
        stream.close()
        return stopped_early, eval_metrics

    def _maybe_evaluate(self, epoch_ended: bool, metrics: dict[str, float]) -> tuple[bool, bool, dict]:
        """Evaluate when the evaluator says so (not at the last step: `fit` does that one). Returns
        (evaluated, stop early, the metrics)."""
        ev = self.evaluator
        if ev is None or self.step >= self.total_steps or not ev.due(self.step, epoch_ended):
            return False, False, metrics
        metrics = self.evaluate("epoch end" if epoch_ended else "scheduled")
        stop = self._agree(ev.should_stop)
        if stop and self.ctx.is_main:
            log.info(
                "early stop at step %d: no %s improvement in %d evaluations (best %.4f at step %d)",
                self.step,
                ev.monitor,
                ev.patience,
                ev.best,
                ev.best_step,
            )
        return True, stop, metrics

    def _maybe_save(self) -> bool:
        """Checkpoint every ``--ckpt-every`` steps (not at the last step: `fit` saves at the end)."""
        every = self.cfg.ckpt_every
        if every and self.step % every == 0 and self.step < self.total_steps:
            self.save()
            return True
        return False

    # --- preemption ------------------------------------------------------------------------------------
    def _arm(self) -> dict | None:
        """With ``MARIANA_PREEMPTIBLE=1`` (set by the Slurm batch script) SIGTERM and SIGUSR1 only note the
        signal: the loop checkpoints at the next step boundary and exits `PREEMPTED_EXIT`. Returns the old
        handlers (None when not armed: not asked for, or not the main thread)."""
        self._armed = os.environ.get("MARIANA_PREEMPTIBLE") == "1"
        if not self._armed or threading.current_thread() is not threading.main_thread():
            self._armed = False
            return None

        def note(signum, _frame):
            self.signalled = signal.Signals(signum).name

        return {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGUSR1)}

    def _maybe_preempt(self, stream, logged: bool) -> None:
        """After a step: if any rank got a preemption signal, every rank writes the checkpoint of this step
        and exits. Several ranks agree by one all-reduce of a flag at logged steps only (they read the device
        anyway: no other step waits for it), so the signal's lead must cover ``--log-every`` steps."""
        if self.ctx.distributed and not logged:
            return
        if not self._agree(self.signalled is not None, any_rank=True):
            return
        stream.close()
        self.logger.flush(self.step_obj)
        self.save()
        if self.ctx.is_main:
            log.warning("%s: checkpointed at step %d; exiting with status %d to be requeued",
                        self.signalled or "a preemption signal", self.step, PREEMPTED_EXIT)  # fmt: skip
        raise SystemExit(PREEMPTED_EXIT)

    def _export_final(self, eval_metrics: dict[str, float]) -> None:
        """Export at the end: always without a monitored metric, else only if nothing was exported yet."""
        if self.exporter is None:
            return
        if (self.evaluator is None or not self.evaluator.monitor) or self.exported_step < 0:
            self.exporter({f"eval_{k}": v for k, v in eval_metrics.items()}, self.step)
            self.exported_step = self.step
