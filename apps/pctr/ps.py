"""The parameter-server mode of `mariana pctr train`: one torchrun process per server or worker.

Servers hold the sharded table (and, server 0, the dense parameters and their optimiser, and with
``--ids dynamic`` the id map: README "Dynamic ids"); each worker runs the one platform `Trainer` with the
framework's `PSWorkerStep` (pull -> compute -> push, asynchronous or with bounded staleness) and the
servers' checkpoints (`ServerCheckpointer`). Worker 0 evaluates, keeps the best model (assembled from the
servers) and, once every worker is done, writes the final checkpoint and metrics. The processes' start-up,
serving and transport are the framework's (`mariana.platform.ps.job`); this module is pCTR's wiring.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch
from mariana.platform.core.evaluator import auc_logloss
from mariana.platform.ps.job import TableClient, assemble_model, build_server, serve, start_process
from mariana.platform.ps.pull import predict_batches, write_counter
from mariana.platform.ps.runtime import ps_session
from mariana.platform.ps.worker import PSClient
from mariana.platform.ps.worker_step import PSWorkerStep, RemoteIdMap, ServerCheckpointer
from mariana.platform.runtime.dist import DistContext

from .configs import DenseOptim, Ids, Net, PctrConfig, Table
from .data.reader import ClickSource
from .data.sources import DataSources
from .ids.idmap import FrozenIdMap
from .models.nets import build_model
from .models.optim import row_config
from .models.step import build_dense_only, idmap_for, make_worker_step
from .train import Setup, export, make_trainer

log = logging.getLogger("mariana")


def run_ps_process(cfg: PctrConfig, sources: DataSources | None = None) -> int:
    """Body of one torchrun process of a parameter-server job (role from RANK); ``sources``: its
    ``--data`` resolved. Servers build the schema and never count lines; workers count them once."""
    role, run = start_process(cfg.servers, cfg.workers, cfg.out)
    st = Setup(cfg, ClickSource.from_sections(cfg.input, cfg.rows, sources))
    if role.kind == "server":
        server, restored = make_server(
            role, run, st, cfg.net, cfg.table, cfg.optim, cfg.rows, cfg.staleness, cfg.seed
        )
        return serve(server, role, run, restored, cfg.timeout)
    with ps_session(role, cfg.timeout):
        return _work(cfg, role, run, st)


def make_server(
    role, run, st: Setup, net: Net, table: Table, optim: DenseOptim, rows: Ids, staleness: int, seed: int
):
    """This server's shard of the table (its row rule: the ``table`` section), its slice of the dense
    parameters (``net``, initialised as one-process training initialises them from ``seed``) with their
    optimiser (``optim``), the id map on server 0 with ``--ids dynamic`` (``rows``), restored from the
    latest checkpoint if there is one. Returns (ParamServer, restored step or None)."""
    torch.manual_seed(seed)
    dense = build_dense_only(net, st.schema, table.init_std)  # in-process training's initial dense layers
    keymap = idmap_for(rows, st.schema) if role.index == 0 else None
    return build_server(
        role, run, st.spec, row_config(table), dense, optim.optimizer, optim.lr, staleness, seed, keymap
    )


def assemble(net: Net, ids: str, st: Setup, client, step: PSWorkerStep):
    """(the full `CTRModel` of the ``net`` section from the servers, table [N, K], seen [N]); with ``ids``
    ``"dynamic"``, ``st.idmap`` set to server 0's map, which `export` writes."""
    full, weight, seen = assemble_model(
        client, step.model, lambda w: build_model(net, st.schema, table=w), st.spec.num_rows
    )
    st.idmap = None
    if ids == "dynamic":  # server 0's map: the key held by each row (export) and its counters (metrics)
        got = client.keymap_state()
        st.idmap = SimpleNamespace(row_key=got["row_key"].numpy(), counters=got["counters"])
    return full, weight, seen


def _work(cfg: PctrConfig, role, run, st: Setup) -> int:
    """A worker: train its share with the platform `Trainer`; worker 0 then finishes the job."""
    cache_dir = run.path / "row-cache" / f"worker-{role.index}"
    data = st.worker_data(role.index, role.num_workers, cache_dir=cache_dir)
    total = st.total_steps(data.steps_per_epoch)
    cpu = torch.device("cpu")
    val, val_labels = st.val_batches(cpu)
    client = PSClient(role.num_servers, role.index, cfg.staleness, cfg.timeout)
    step = make_worker_step(cfg, st.schema, client, role, run)
    t0 = time.perf_counter()
    remote_map = RemoteIdMap(client) if cfg.ids == "dynamic" else None  # --ids dynamic: on server 0

    def validate(s: PSWorkerStep) -> dict[str, float]:
        m = auc_logloss(val_labels, predict_batches(s.model, val, client, cpu, idmap=remote_map))
        rec = {"step": s.t, "val_auc": m["auc"], "val_logloss": m["logloss"]}
        rec.update({"samples_per_s": s.n / (time.perf_counter() - t0), "attempt": role.attempt})
        write_counter(run, role.index, rec)
        return m

    def export_best(metrics: dict, at_step: int) -> None:
        full, weight, seen = assemble(cfg.net, cfg.ids, st, client, step)
        export(run, st, full, weight, seen, {"metrics": {**metrics, "step": at_step}})

    ctx = DistContext(rank=role.index, device=cpu)  # no process group: workers talk to servers only
    checkpointer = ServerCheckpointer(client, role.index, total, data.steps_per_epoch)
    exporter = export_best if role.index == 0 else None  # worker 0 keeps the model
    validate = validate if len(val_labels) else None
    trainer = make_trainer(cfg, step, data, ctx, run, validate, exporter, total, checkpointer)
    final = trainer.fit()
    data.close()  # its row shards (kept by a failed attempt for the restarted one)
    client.done()
    if role.index == 0:
        client.wait_all_done()
        client.checkpoint(total)
        assembled = assemble(cfg.net, cfg.ids, st, client, step)
        _finish(
            assembled, role, run, st, client, trainer, final, data, (val, val_labels), total, cfg.staleness
        )
        client.finish_servers()
    return 0


def _finish(
    assembled, role, run, st: Setup, client, trainer, final: dict, data, validation, total, staleness
) -> None:
    """Worker 0 once every worker is done: the final model (``assembled``: `assemble`'s; worker 0's own
    last evaluation may predate the other workers' last pushes: asynchronous SGD), exported unless the
    best evaluated one is better, and metrics.json."""
    val, val_labels = validation
    full, weight, seen = assembled
    frozen = None
    if st.idmap is not None:
        frozen = FrozenIdMap(st.idmap.row_key, st.schema.num_fields, st.schema.rows_per_field)
    cpu = torch.device("cpu")
    end = auc_logloss(val_labels, predict_batches(full, val, TableClient(weight), cpu, idmap=frozen))
    ev = trainer.evaluator
    mon = ev.monitor if ev is not None and ev.monitor else "auc"
    keep_best = (
        ev is not None
        and ev.best is not None
        and trainer.exported_step >= 0
        and not (end[mon] >= ev.best if ev.maximize else end[mon] <= ev.best)
    )
    if keep_best:
        best = next((h for h in trainer.history if h["step"] == ev.best_step), {})
        chosen = {k: best.get(f"eval_{k}", float("nan")) for k in ("auc", "logloss")}
    else:
        chosen = end
        metrics = {"eval_auc": end["auc"], "eval_logloss": end["logloss"], "step": total}
        export(run, st, full, weight, seen, {"metrics": metrics})
        final["exported_step"] = final["steps"]
    final.update(
        {
            "val_auc": chosen["auc"],
            "val_logloss": chosen["logloss"],
            "final_val_auc": end["auc"],
            "epochs": trainer.history,
            "mode": "parameter-server",
            "servers": role.num_servers,
            "workers": role.num_workers,
            "staleness": staleness,
            "worker0_samples_per_s": final.get("samples_per_s", 0.0),
            "skipped_lines": data.stats.skipped,
            "skipped_examples": {str(k): v for k, v in list(data.stats.errors.items())[:10]},
            "server_counters": client.server_counters,
            **({"ids": st.idmap.counters} if st.idmap is not None else {}),
        }
    )
    run.write_final(final)
