"""Parameter-server cost model: pull and push times measured over real RPC, fitted, checked against real
`mariana pctr train --servers S --workers W` runs on this machine, and a PREDICTION for larger clusters.

1. Worker compute per step ``c``: the parameter-server worker's own step (`train_step` with the dense
   parameters pulled and pushed as flat vectors) on real batches of the data, one thread (every process
   of a parameter-server job runs one), with the rows handed over in memory instead of by RPC.
2. RPC sweep: torchrun starts this file as 1 server + 1 client (the real `ParamServer` / `PSClient` over
   TensorPipe on loopback); the client times a pull (rows + the dense vector) and a push (row and dense
   gradients, applied by the server's Adagrad / Adam before the reply) for U unique rows over a sweep of U.
   Each is fitted as ``t = a + bytes / bw``.
3. Model of a step of one worker with ``--pull-ahead``, S servers, W workers, the rows spread evenly:
   the pull of step t+1 travels while step t computes, and the push of step t is awaited before the push of
   t+1, so a worker's step is ``max(c, t_pull(S), t_push(S))`` where each server handles 1/S of the bytes
   (the S requests go out in parallel). A server is busy ``W * (t_pull(S) + t_push(S))`` per round
   of steps (every worker pulls and pushes once), which caps the round's rate. Processes beyond the
   machine's cores share them: every time is scaled by ``max(1, processes per machine / cores)``. Across
   machines each transfer also crosses a link of ``--link-gbps`` with ``--link-latency-us`` per RPC.
   A machine's link carries the bytes of its workers that leave it. samples/s = W * B / max(worker step,
   server round, link time per round).
4. The model is checked against the configurations this machine can run (S=1 with W=1 and W=2), then
   evaluated for larger clusters. Those rows are PREDICTIONS (labelled so), not measurements.

Usage: ``python bench/ps_cost_model.py`` (minutes on 2 cores; writes
bench/results/ps_cost_model-cpu.json). ``--job`` is the torchrun entry of step 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_result  # noqa: E402
from pctr_throughput import generate, ps_train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SWEEP_U = [512, 2048, 8192, 32768]


def _config(args):
    from mariana.apps.pctr.configs import PctrConfig

    return PctrConfig(
        data=str(args.data), format="criteo", model="deepfm", rows_per_field=args.rows_per_field,
        batch_size=args.batch,
    )  # fmt: skip


class _InMemoryRows:
    """A client whose pulls return stored rows and whose pushes return at once: the worker's step with
    the transport and the servers' work taken out."""

    def __init__(self, width: int, dense: torch.Tensor):
        self.width, self.dense = width, dense

    def pull(self, reqs, step=-1, want_dense=False):
        rows = {n: torch.full((r.numel(), self.width), 0.01) for n, r in reqs.items()}
        return rows, (self.dense.clone() if want_dense else None)

    def push(self, grads, dense_grad=None, step=-1):
        pass


def worker_compute(args, batches) -> dict:
    """Seconds per step of a worker's compute (one thread) and the mean unique rows per batch."""
    from mariana.apps.pctr.data.encoding import infer_schema
    from mariana.apps.pctr.models.step import build_dense_only
    from mariana.platform.ps.dense import flatten
    from mariana.platform.ps.pull import train_step

    cfg = _config(args)
    schema = infer_schema(args.data, "criteo", args.rows_per_field)
    torch.set_num_threads(1)  # a parameter-server process's budget (apps/pctr/ps.py)
    torch.manual_seed(0)
    model = build_dense_only(cfg.net, schema, cfg.init_std)
    client = _InMemoryRows(1 + cfg.dim, flatten(model.dense_parameters()))
    times = []
    for i, b in enumerate(batches):
        t0 = time.perf_counter()
        train_step(model, client, b, i, torch.device("cpu"), remote_dense=True)
        times.append(time.perf_counter() - t0)
    uniq = [torch.unique(b.ids).numel() for b in batches]
    torch.set_num_threads(os.cpu_count() or 1)
    return {
        "step_s": statistics.median(times[3:]),
        "unique_rows": float(np.mean(uniq)),
        "dense_values": client.dense.numel(),
        "row_width": 1 + cfg.dim,
    }


def job(out: str, rows: int, width: int, dense: int, reps: int) -> int:
    """torchrun entry: rank 0 serves one table of ``rows x width`` and ``dense`` values; rank 1 times pulls
    and pushes of U unique rows (+ the dense vector) for U in SWEEP_U, writing ``out`` (JSON)."""
    from mariana.platform.ps.dense import DenseStore
    from mariana.platform.ps.rowopt import RowOptConfig
    from mariana.platform.ps.runtime import ps_session, role_from_env
    from mariana.platform.ps.server import ParamServer
    from mariana.platform.ps.shard import EmbeddingShard, TableSpec
    from mariana.platform.ps.worker import PSClient

    torch.set_num_threads(1)
    role = role_from_env(1, 1)
    spec = TableSpec("table", rows, width)
    if role.kind == "server":
        shard = EmbeddingShard([spec], 0, 1, RowOptConfig(rule="adagrad", lr=0.05), seed=0)
        server = ParamServer(0, 1, 1, shard, DenseStore(torch.zeros(dense), "adam", 1e-3))
        with ps_session(role, 600, objects={"ps": server}):
            server.serve(0.05)
        return 0
    res = []
    rng = np.random.default_rng(0)
    step = 0  # one increasing step for all pushes: a server skips a push whose step it applied already

    def draw(U: int) -> torch.Tensor:
        """U distinct rows, power-law like the data's ids (hot rows recur), topped up uniformly."""
        ids = np.unique(rng.zipf(1.2, 4 * U) % rows)[:U]
        while len(ids) < U:
            ids = np.unique(np.concatenate([ids, rng.integers(0, rows, U - len(ids))]))
        return torch.from_numpy(ids)  # np.unique: sorted already

    with ps_session(role, 600):
        client = PSClient(1, 0)
        for U in SWEEP_U:
            pulls, pushes = [], []
            for k in range(reps + 3):  # the first 3 untimed: pages of rows first touched
                ids = draw(U)
                t0 = time.perf_counter()
                client.pull({"table": ids}, step, True)
                t_pull = time.perf_counter() - t0
                t0 = time.perf_counter()
                client.push({"table": (ids, torch.full((U, width), 1e-3))}, torch.full((dense,), 1e-3), step)
                client.wait()
                t_push = time.perf_counter() - t0
                step += 1
                if k >= 3:
                    pulls.append(t_pull)
                    pushes.append(t_push)
            nbytes = 4 * (U * width + dense) + 8 * U  # rows or gradients, the dense vector, the ids
            res.append(
                {
                    "U": U,
                    "bytes": nbytes,
                    "pull_s": statistics.median(pulls),
                    "push_s": statistics.median(pushes),
                }
            )
        client.finish_servers()
    Path(out).write_text(json.dumps(res))
    return 0


def rpc_sweep(args, width: int, dense: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sweep.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        cmd += [__file__, "--job", str(out), "--job-rows", str(39 * args.rows_per_field)]
        cmd += ["--job-width", str(width), "--job-dense", str(dense), "--job-reps", str(args.reps)]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"RPC sweep failed:\n{r.stderr[-3000:]}")
        return json.loads(out.read_text())


def fit(sweep: list[dict], key: str) -> tuple[float, float]:
    """Least squares ``t = a + bytes / bw``: (a seconds, bw bytes/s)."""
    x = np.array([s["bytes"] for s in sweep], dtype=float)
    y = np.array([s[key] for s in sweep], dtype=float)
    slope, a = np.polyfit(x, y, 1)
    return max(float(a), 0.0), 1.0 / max(float(slope), 1e-15)


def predict(m: dict, S: int, W: int, N: int, cores: int, link_gbps: float, link_lat_s: float) -> float:
    """samples/s of S servers + W workers spread evenly over N machines of ``cores`` cores (see the top)."""
    per_machine = -(-(S + W) // N)
    slow = max(1.0, per_machine / cores)  # processes beyond the cores share them
    U, width, P, B = m["unique_rows"], m["row_width"], m["dense_values"], m["batch"]
    nbytes = 4 * (U * width + P) + 8 * U
    remote = 0.0 if N == 1 else (1 - 1 / N)  # share of a worker's bytes that leave its machine

    def t(kind: str) -> float:
        a, bw = m[f"{kind}_fit"]
        wire = remote * (link_lat_s + nbytes / S / (link_gbps * 1e9 / 8))
        return (a + nbytes / S / bw) * slow + wire

    t_pull, t_push = t("pull"), t("push")
    worker = max(m["compute_s"] * slow, t_pull, t_push)
    server = W * (t_pull + t_push)  # each server answers every worker's pull and push once per round
    # a machine's link carries its workers' pulls and pushes that leave it
    nic = remote * 2 * nbytes * (W / N) / (link_gbps * 1e9 / 8)
    return W * B / max(worker, server, nic)


def measured_runs(args) -> dict[str, float]:
    """samples/s of real runs on this machine over epoch 2 (parsing done, batches from the cache)."""
    out = {}
    for w in (1, 2):
        run = args.data.parent / f"cost-ps-w{w}"
        out[f"S1_W{w}"] = ps_train(args.data, run, args.rows_per_field, args.batch, w)["samples_per_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("runs/bench-criteo-1m/criteo_synth.tsv"))
    ap.add_argument("--rows", type=int, default=300_000, help="generated lines (if --data is missing)")
    ap.add_argument("--rows-per-field", type=int, default=1_000_000, help="hash space per field")
    ap.add_argument("--batch", type=int, default=2048, help="batch size per worker")
    ap.add_argument("--reps", type=int, default=15, help="timed pulls and pushes per sweep point")
    ap.add_argument("--link-gbps", type=float, default=25.0, help="assumed link between machines, Gbit/s")
    ap.add_argument("--link-latency-us", type=float, default=50.0, help="assumed extra latency per RPC")
    ap.add_argument("--cores", type=int, default=16, help="cores per machine in the predictions")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--job-rows", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--job-width", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--job-dense", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--job-reps", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        return job(args.job, args.job_rows, args.job_width, args.job_dense, args.job_reps)

    from mariana.apps.pctr.data.encoding import Encoder, infer_schema, iter_batches, iter_chunks

    if not args.data.is_file():
        args.data.parent.mkdir(parents=True, exist_ok=True)
        print(f"generating {args.rows} lines into {args.data} ...", flush=True)
        generate(args.data, args.rows, args.rows_per_field, 1.2)
    enc = Encoder(infer_schema(args.data, "criteo", args.rows_per_field))
    chunks = iter_chunks(args.data, enc, 0, 40 * args.batch)
    batches = list(iter_batches(chunks, args.batch, drop_last=True))[:30]
    print("1/3 worker compute per step (1 thread) ...", flush=True)
    m = worker_compute(args, batches)
    m["batch"] = args.batch
    print("2/3 pull/push sweep over RPC (1 server + 1 client) ...", flush=True)
    sweep = rpc_sweep(args, m["row_width"], m["dense_values"])
    m["pull_fit"], m["push_fit"] = fit(sweep, "pull_s"), fit(sweep, "push_s")
    m["compute_s"] = m.pop("step_s")
    print("3/3 real parameter-server runs (1 server, 1 and 2 workers) ...", flush=True)
    measured = measured_runs(args)
    lat = args.link_latency_us * 1e-6

    def pred(S, W, N, cores):
        return predict(m, S, W, N, cores, args.link_gbps, lat)

    cores_here = os.cpu_count() or 1
    check = []
    for w in (1, 2):
        p, got = pred(1, w, 1, cores_here), measured[f"S1_W{w}"]
        check.append(
            {"config": f"1 server, {w} worker(s), this machine", "measured": round(got), "model": round(p),
             "model/measured": round(p / got, 2)}
        )  # fmt: skip
    # one server per three workers (the ratio the fit favours), and one starved layout for contrast
    layouts = [(1, 1, 1), (4, 12, 1), (8, 24, 2), (16, 48, 4), (32, 96, 8), (64, 192, 16), (4, 28, 2)]
    one = pred(1, 1, 1, args.cores)
    preds = []
    for S, W, N in layouts:
        p = pred(S, W, N, args.cores)
        preds.append(
            {"servers": S, "workers": W, "machines": N, "PREDICTED samples/s": round(p),
             "PREDICTED efficiency": round(p / (W * one), 2)}
        )  # fmt: skip
    sweep_rows = [
        {"U rows": s["U"], "bytes": s["bytes"], "pull ms": round(s["pull_s"] * 1e3, 2),
         "push ms": round(s["push_s"] * 1e3, 2)}
        for s in sweep
    ]  # fmt: skip
    print(f"\nworker compute {m['compute_s'] * 1e3:.1f} ms/step at batch {args.batch} (1 thread), "
          f"{m['unique_rows']:.0f} unique rows/step, {m['dense_values']} dense values")  # fmt: skip
    print(table(sweep_rows, ["U rows", "bytes", "pull ms", "push ms"]))
    (pa, pbw), (qa, qbw) = m["pull_fit"], m["push_fit"]
    print(f"fit: pull {pa * 1e3:.2f} ms + bytes / {pbw / 1e6:.0f} MB/s; push {qa * 1e3:.2f} ms + bytes / "
          f"{qbw / 1e6:.0f} MB/s\n")  # fmt: skip
    print(table(check, ["config", "measured", "model", "model/measured"]))
    print(f"\nPREDICTION ({args.cores} cores per machine, {args.link_gbps:g} Gbit/s links, "
          f"{args.link_latency_us:g} us per RPC between machines):")  # fmt: skip
    print(table(preds, ["servers", "workers", "machines", "PREDICTED samples/s", "PREDICTED efficiency"]))
    path = write_result(
        "ps_cost_model",
        {"benchmark": "ps_cost_model", "setup": {k: str(v) for k, v in vars(args).items() if not k.startswith("job")},
         "model_inputs": m, "sweep": sweep, "check_on_this_machine": check, "prediction": preds},
    )  # fmt: skip
    print(f"results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
