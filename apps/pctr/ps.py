"""The parameter-server mode of `mariana pctr train`: one torchrun process per server or worker.

Servers hold the sharded table (and, server 0, the dense parameters and their optimiser, and with
``--ids dynamic`` the id map: README "Dynamic ids"); each worker
runs the one platform `Trainer` with a `PSWorkerStep` (pull -> compute -> push, asynchronous or with
bounded staleness) and the servers' checkpoints (`ServerCheckpointer`). Worker 0 evaluates, keeps the best
model (dumped from the servers) and, once every worker is done, writes the final checkpoint and metrics.
"""

from __future__ import annotations

import json
import logging
import time
from typing import NamedTuple

import numpy as np
import torch
from mariana.platform.core.metrics import auc_logloss
from mariana.platform.core.rundir import RunDir, setup_logging
from mariana.platform.ps.memory import keep_freed_memory

from .configs import PctrConfig
from .model import build_model
from .optim import row_config
from .step import (
    TABLE,
    PSWorkerStep,
    RemoteIdMap,
    ServerCheckpointer,
    build_dense_only,
    predict_batches,
    write_counter,
)
from .train import Setup, WorkerData, export, make_trainer

log = logging.getLogger("mariana")


def start_ps_process(cfg: PctrConfig):
    """What every torchrun process of a parameter-server job (training or stream) does first: its role
    (from RANK), the run directory with this rank's log file, one intra-op thread. Returns (role, run)."""
    from mariana.platform.ps.runtime import role_from_env

    role = role_from_env(cfg.servers, cfg.workers)
    keep_freed_memory()
    run = RunDir(cfg.out)
    setup_logging(run, rank=role.rank)
    torch.set_num_threads(1)
    return role, run


def run_ps_process(cfg: PctrConfig) -> int:
    """Body of one torchrun process of a parameter-server job (role from RANK)."""
    from mariana.platform.ps.runtime import rpc_session

    role, run = start_ps_process(cfg)
    if role.kind == "server":
        return _serve(cfg, role, run, rpc_session)
    return _work(cfg, role, run, rpc_session)


def build_server(cfg, role, run, st: Setup):
    """This server's shard of the table, its slice of the dense parameters (initialised as one-process
    training initialises them), the id map on server 0 with ``--ids dynamic``, restored from the latest
    checkpoint if there is one. Returns (ParamServer, restored step or None)."""
    from mariana.platform.ps.dense import DenseStore, flatten
    from mariana.platform.ps.server import ParamServer
    from mariana.platform.ps.shard import EmbeddingShard, contiguous_part

    shard = EmbeddingShard([st.spec], role.index, role.num_servers, row_config(cfg), cfg.seed)
    torch.manual_seed(cfg.seed)
    flat = flatten(build_dense_only(cfg, st.schema).dense_parameters())  # in-process training's init
    lo, hi = contiguous_part(flat.numel(), role.index, role.num_servers)
    dense = DenseStore(flat[lo:hi], cfg.optimizer, cfg.lr)  # this server's slice of the dense parameters
    del flat
    server = ParamServer(
        role.index, role.num_servers, role.num_workers, shard, dense, cfg.staleness, run.ckpt_dir
    )
    if cfg.ids == "dynamic" and role.index == 0:  # the id map of every field, in its checkpoint shard
        from .idmap import IdMap

        s = st.schema
        server.keymap = IdMap(s.num_fields, s.rows_per_field, cfg.admit_after, cfg.evict, cfg.sketch_width)
    restored = server.restore_latest()
    if restored is not None:
        log.info(
            "server %d: restored shard from checkpoint step %d (attempt %d)",
            role.index,
            restored,
            role.attempt,
        )
    return server, restored


def _serve(cfg, role, run, rpc_session) -> int:
    from mariana.platform.core.faults import FaultInjector
    from mariana.platform.ps.server import install

    server, restored = build_server(cfg, role, run, Setup(cfg))
    fault = FaultInjector("push")  # MARIANA_FAULT's server=S:push=N entries (see platform/core/faults.py)
    if fault.at:
        orig = server.push

        def push(*a, **k):
            fault.maybe_fire(server.counters["pushes"] + 1)
            return orig(*a, **k)

        server.push = push
    install(server)
    with rpc_session(role, cfg.timeout):
        server.serve()
    (run.path / "counters" / f"server-{role.index}.json").write_text(
        json.dumps(
            {
                **server.counters,
                **(server.keymap.counters() if server.keymap is not None else {}),
                "restored_from": restored,
                "attempt": role.attempt,
            }
        )
        + "\n"
    )
    return 0


def _work(cfg, role, run, rpc_session) -> int:
    from mariana.platform.ps.dense import unflatten_into
    from mariana.platform.ps.worker import PSClient
    from mariana.platform.runtime.dist import DistContext

    st = Setup(cfg)
    a, b = st.bounds["train"]
    data = WorkerData(
        st.sources, st.encoder, a, b, cfg.batch_size, role.index, role.num_workers, cfg.seed, cfg.shuffle,
        cache_gb=cfg.cache_gb, cache_dir=run.path / "row-cache" / f"worker-{role.index}",
    )  # fmt: skip
    total = st.total_steps(data.steps_per_epoch)
    cpu = torch.device("cpu")
    val, val_labels = st.val_batches(cpu)
    with rpc_session(role, cfg.timeout):
        client = PSClient(role.num_servers, role.index, cfg.staleness, cfg.timeout)
        step = PSWorkerStep(cfg, st.schema, client, role, run)
        t0 = time.perf_counter()

        remote_map = RemoteIdMap(client) if cfg.ids == "dynamic" else None  # --ids dynamic: on server 0

        def validate(s: PSWorkerStep) -> dict[str, float]:
            m = auc_logloss(val_labels, predict_batches(s.model, val, client, cpu, idmap=remote_map))
            write_counter(
                run,
                role.index,
                {
                    "step": s.t,
                    "val_auc": m["auc"],
                    "val_logloss": m["logloss"],
                    "samples_per_s": s.n / (time.perf_counter() - t0),
                    "attempt": role.attempt,
                },
            )
            return m

        def export_best(metrics: dict, at_step: int) -> None:
            if role.index != 0:
                return
            tables, dense_flat = client.dump({TABLE: st.spec.num_rows})
            unflatten_into(dense_flat, step.model.dense_parameters())
            weight, seen = tables[TABLE]
            full = build_model(cfg, st.schema, table=weight)
            full.load_dense_state_dict(step.model.state_dict())
            st.idmap = _server_idmap(client, cfg)  # `export` writes its idmap.row_key
            export(run, st, full, weight, seen, {"metrics": {**metrics, "step": at_step}})

        ctx = DistContext(rank=role.index, device=cpu)  # no process group: workers talk to servers only
        trainer = make_trainer(
            cfg,
            step,
            data,
            ctx,
            run,
            validate if len(val_labels) else None,
            export_best,
            total,
            ServerCheckpointer(client, role.index, total, data.steps_per_epoch),
        )
        if role.index != 0:
            trainer.exporter = None  # worker 0 keeps the model
        final = trainer.fit()
        data.close()  # its row shards (kept by a failed attempt for the restarted one)
        client.done()
        if role.index == 0:
            client.wait_all_done()
            client.checkpoint(total)
            # the final model once every worker is done: worker 0's own last evaluation may predate the
            # other workers' last pushes (asynchronous SGD)
            tables, dense_flat = client.dump({TABLE: st.spec.num_rows})
            unflatten_into(dense_flat, step.model.dense_parameters())
            weight, seen = tables[TABLE]
            full = build_model(cfg, st.schema, table=weight)
            full.load_dense_state_dict(step.model.state_dict())
            st.idmap = _server_idmap(client, cfg)
            frozen = None
            if st.idmap is not None:
                from .idmap import FrozenIdMap

                frozen = FrozenIdMap(st.idmap.row_key, st.schema.num_fields, st.schema.rows_per_field)
            end = auc_logloss(val_labels, predict_batches(full, val, _TableClient(weight), cpu, idmap=frozen))
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
                chosen = {
                    "auc": best.get("eval_auc", float("nan")),
                    "logloss": best.get("eval_logloss", float("nan")),
                }
            else:
                chosen = end
                export(
                    run,
                    st,
                    full,
                    weight,
                    seen,
                    {"metrics": {"eval_auc": end["auc"], "eval_logloss": end["logloss"], "step": total}},
                )
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
                    "staleness": cfg.staleness,
                    "worker0_samples_per_s": final.get("samples_per_s", 0.0),
                    "skipped_lines": data.stats.skipped,
                    "skipped_examples": {str(k): v for k, v in list(data.stats.errors.items())[:10]},
                    "server_counters": client.server_counters,
                    **({"ids": st.idmap.counters} if st.idmap is not None else {}),
                }
            )
            run.write_final(final)
            client.finish_servers()
    return 0


class _ServerIdMap(NamedTuple):
    """Server 0's `--ids dynamic` map as `export` and the final metrics need it."""

    row_key: np.ndarray  # [F R] int64: the key held by each row, -1 none
    counters: dict  # `IdMap.counters()`


def _server_idmap(client, cfg) -> _ServerIdMap | None:
    if cfg.ids != "dynamic":
        return None
    got = client.keymap_state()
    return _ServerIdMap(got["row_key"].numpy(), got["counters"])


class _TableClient:
    """Pull from a full in-memory table (scores the assembled model)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def pull(self, reqs, step=-1, want_dense=False):
        return {n: self.weight.index_select(0, r) for n, r in reqs.items()}, None
