"""The parameter servers' transport, side by side: torch.distributed.rpc (TensorPipe, what the servers used
until the switch; in maintenance mode), ZeroMQ (pyzmq, `mariana.platform.ps.transport`, what they use now)
and gRPC (grpcio, generic bytes handlers: gRPC Python takes and gives ``bytes``, so a tensor is copied
into and out of each message).

One server process (a table of ``--rows`` x 17 float32, one thread) and one client process (this one) on
loopback. Measured per transport, after ``--warmup`` untimed calls:
- pull: latency of a pull of ``--unique`` (40,000) distinct rows (ids [U] int64 out, rows [U, 17] back),
  median and p90 over ``--reps`` calls;
- push: pushes/s of ``--unique`` rows' gradients (ids + [U, 17] float32 out, the server applies SGD with
  ``index_add_`` and acknowledges), one push in flight as a worker sends them.

Usage: ``python bench/ps_transport.py`` (about a minute per round, ``--rounds`` 3, the
median of each column over the rounds; writes bench/results/ps_transport-cpu.json and
prints one table). Needs ``pip install -e '.[bench]'`` for grpcio (skipped with a note without it).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_result  # noqa: E402

WIDTH = 17
TABLE: torch.Tensor | None = None  # the server process's table


def serve_pull(ids: torch.Tensor) -> torch.Tensor:
    return TABLE.index_select(0, ids)


def serve_push(ids: torch.Tensor, grad: torch.Tensor) -> bool:
    TABLE.index_add_(0, ids, grad, alpha=-0.01)
    return True


class Table:
    """The object the ZeroMQ server serves."""

    def pull(self, ids):
        return serve_pull(ids)

    def push(self, ids, grad):
        return serve_push(ids, grad)


def _tensor_bytes(*ts: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, *[t.numpy() for t in ts])
    return buf.getvalue()


def _from_bytes(b: bytes) -> list[torch.Tensor]:
    z = np.load(io.BytesIO(b))
    return [torch.from_numpy(z[f"arr_{i}"]) for i in range(len(z.files))]


def server(kind: str, rows: int, port: int) -> None:
    """The server process of transport ``kind``: prints its address, serves until killed (zmq, grpc) or
    until the RPC group shuts down (rpc)."""
    global TABLE
    torch.set_num_threads(1)
    TABLE = torch.randn(rows, WIDTH)
    if kind == "rpc":
        from torch.distributed import rpc

        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=4)
        rpc.init_rpc("server", rank=0, world_size=2, rpc_backend_options=opts)
        rpc.shutdown()
    elif kind == "zmq":
        from mariana.platform.ps.transport import Server

        print(Server({"t": Table()}, b"bench", threads=4).address, flush=True)
        time.sleep(3600)
    else:
        from concurrent import futures

        import grpc

        def pull(req, ctx):
            return _tensor_bytes(serve_pull(*_from_bytes(req)))

        def push(req, ctx):
            serve_push(*_from_bytes(req))
            return b"1"

        handlers = {"pull": grpc.unary_unary_rpc_method_handler(pull)}
        handlers["push"] = grpc.unary_unary_rpc_method_handler(push)
        opts = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]
        srv = grpc.server(futures.ThreadPoolExecutor(4), options=opts)
        srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t", handlers)])
        srv.add_insecure_port(f"127.0.0.1:{port}")
        srv.start()
        print(f"127.0.0.1:{port}", flush=True)
        srv.wait_for_termination()


def client(kind: str, port: int, address: str):
    """(pull(ids) -> rows, push(ids, grad) -> None waited, close()) of transport ``kind``."""
    if kind == "rpc":
        from torch.distributed import rpc

        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=4)
        rpc.init_rpc("client", rank=1, world_size=2, rpc_backend_options=opts)
        return (
            lambda ids: rpc.rpc_sync("server", serve_pull, (ids,)),
            lambda ids, g: rpc.rpc_sync("server", serve_push, (ids, g)),
            rpc.shutdown,
        )
    if kind == "zmq":
        from mariana.platform.ps.transport import Client, Handle

        c = Client([address], b"bench")
        h = Handle(c, 0, "t")
        return h.rpc_sync().pull, h.rpc_sync().push, c.close
    import grpc

    opts = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]
    ch = grpc.insecure_channel(address, options=opts)
    pull, push = ch.unary_unary("/t/pull"), ch.unary_unary("/t/push")
    return (
        lambda ids: _from_bytes(pull(_tensor_bytes(ids)))[0],
        lambda ids, g: push(_tensor_bytes(ids, g)),
        ch.close,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(kind: str, args) -> dict:
    port = free_port()
    cmd = [sys.executable, __file__, "--serve", kind, "--port", str(port), "--rows", str(args.rows)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip() if kind != "rpc" else ""
        pull, push, close = client(kind, port, address)
        rng = np.random.default_rng(0)
        draws = [torch.from_numpy(rng.choice(args.rows, args.unique, replace=False)) for _ in range(8)]
        grad = torch.full((args.unique, WIDTH), 1e-3)
        for i in range(args.warmup):
            assert pull(draws[i % 8]).shape == (args.unique, WIDTH)
            push(draws[i % 8], grad)
        pulls = []
        for i in range(args.reps):
            t0 = time.perf_counter()
            pull(draws[i % 8])
            pulls.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(args.reps):
            push(draws[i % 8], grad)
        push_rate = args.reps / (time.perf_counter() - t0)
        close()
        proc.wait(timeout=60) if kind == "rpc" else None
    finally:
        proc.kill()
        proc.wait()
    pulls.sort()
    return {
        "transport": kind,
        "pull_ms_median": round(1e3 * statistics.median(pulls), 2),
        "pull_ms_p90": round(1e3 * pulls[int(0.9 * (len(pulls) - 1))], 2),
        "pushes_per_s": round(push_rate, 1),
        "bytes_per_pull": args.unique * (8 + 4 * WIDTH),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--unique", type=int, default=40_000)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--transports", default="rpc,zmq,grpc")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        server(args.serve, args.rows, args.port)
        return 0
    torch.set_num_threads(1)
    if args.measure:
        print(json.dumps(measure(args.measure, args)))
        return 0
    runs: dict[str, list[dict]] = {}
    flags = [f"--{k}={getattr(args, k)}" for k in ("rows", "unique", "reps", "warmup")]
    for _ in range(args.rounds):  # interleaved: a change of the machine's load hits every transport
        for kind in args.transports.split(","):
            # each measurement in a fresh client process: a second init_rpc in one process hung at times
            r = subprocess.run(
                [sys.executable, __file__, "--measure", kind, *flags], capture_output=True, text=True
            )
            if r.returncode:
                print(f"{kind}: skipped ({r.stderr.strip().splitlines()[-1]}); pip install -e '.[bench]'")
                continue
            runs.setdefault(kind, []).append(json.loads(r.stdout.strip().splitlines()[-1]))
    rows = []
    for kind, rs in runs.items():  # per column, the median over the rounds
        row = {k: round(statistics.median(x[k] for x in rs), 2) for k in rs[0] if k != "transport"}
        rows.append({"transport": kind, **row, "rounds_pull_ms": [x["pull_ms_median"] for x in rs]})
    print(
        table(
            rows,
            [
                "transport",
                "pull_ms_median",
                "pull_ms_p90",
                "pushes_per_s",
                "bytes_per_pull",
                "rounds_pull_ms",
            ],
        )
    )
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} on {os.cpu_count()} cores (a loaded machine slows every row)")
    path = write_result(
        "ps_transport",
        {
            "rows": args.rows,
            "unique": args.unique,
            "width": WIDTH,
            "reps": args.reps,
            "loadavg_1m": load[0],
            "rounds": args.rounds,
            "results": rows,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
