"""A parameter-server job for test_ps_shard.py, run by torchrun: S=2 servers, 1 worker, the real transport.

Usage: ``python -m torch.distributed.run --standalone --nproc-per-node 3 tests/ps_pushpull_job.py OUT``.
The worker pulls every row of a 10 x 3 table, pushes a gradient of ones for rows [7, 1, 4], pulls again,
then fetches each server's raw shard; everything is saved to ``OUT/result.pt`` for the test to check."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from mariana.platform.ps.runtime import ps_session, role_from_env
from mariana.platform.ps.server import ParamServer
from mariana.platform.ps.shard import EmbeddingShard, TableSpec
from mariana.platform.ps.worker import PSClient
from mariana.platform.sparse.rules import RowOptConfig

SPEC = TableSpec("t", 10, 3, init_std=1.0)
PUSHED = [7, 1, 4]


def main(out: str) -> int:
    torch.set_num_threads(1)
    role = role_from_env(2, 1)
    if role.kind == "server":
        shard = EmbeddingShard([SPEC], role.index, 2, RowOptConfig(rule="sgd", lr=0.5), seed=3)
        server = ParamServer(role.index, 2, 1, shard, None)
        with ps_session(role, 60, objects={"ps": server}):
            server.serve(0.05)
        return 0
    with ps_session(role, 60):
        client = PSClient(2, 0)
        rows = torch.arange(SPEC.num_rows)
        before, _ = client.pull({"t": rows})
        uniq = torch.tensor(PUSHED)
        client.push({"t": (uniq, torch.ones(len(PUSHED), SPEC.dim))}, None, step=0)
        client.push({"t": (uniq, torch.ones(len(PUSHED), SPEC.dim))}, None, step=0)  # replay: ignored
        client.wait()
        perm = torch.tensor([9, 2, 7, 0, 5, 1, 8, 3, 6, 4])  # rows may be requested in any order
        after, _ = client.pull({"t": perm})
        dumps = [h.rpc_sync().dump() for h in client.servers]  # each server's raw shard, through its handle
        client.finish_servers()
    torch.save(
        {
            "before": before["t"],
            "perm": perm,
            "after_perm": after["t"],
            "shards": [d["tables"]["t"] for d in dumps],
            "counters": [d["counters"] for d in dumps],
        },
        Path(out) / "result.pt",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
