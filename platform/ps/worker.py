"""Worker side of the parameter server: pull the rows a batch needs, push their gradients.

`PSClient` talks to the servers through the transport (one request per server per step, all tables
bundled). It takes *global unique* row ids ``[U]`` and return ``[U, K]`` rows; pushes carry the gradient of exactly
those rows (the "sparse gradient" of the batch: U is the number of distinct ids, not B x fields).
"""

from __future__ import annotations

import time

import torch

from .runtime import remote
from .shard import contiguous_part, split_by_shard


class PendingPull:
    """A pull in flight: ``wait()`` -> (table -> rows [U, K], dense flat [P] or None), assembled once
    (the dense vector from every server's slice)."""

    def __init__(self, client: PSClient, reqs: dict[str, torch.Tensor], parts: dict, futs: list):
        self.client, self.reqs, self.parts, self.futs = client, reqs, parts, futs
        self.result = None

    def wait(self):
        if self.result is None:
            t0 = time.perf_counter()
            results = [f.wait() for f in self.futs]
            out = {}
            for i, (n, r) in enumerate(self.reqs.items()):
                for s, res in enumerate(results):
                    rows_s = res[0][i]
                    if n not in out:
                        out[n] = torch.empty(r.numel(), rows_s.shape[1], dtype=rows_s.dtype)
                    out[n].index_copy_(0, self.parts[n][s][0], rows_s)
            dense = [res[1] for res in results if res[1] is not None]
            self.result = out, (torch.cat(dense) if dense else None)  # the slices in server order
            self.client.pull_s += time.perf_counter() - t0  # the time the worker waited for its rows
        return self.result


class PSClient:
    """Client of worker ``worker`` of ``num_workers`` against ``num_servers`` servers ``ps0..``."""

    def __init__(self, num_servers: int, worker: int, staleness: int = -1, timeout_s: float = 300.0):
        self.S, self.worker, self.staleness, self.timeout = num_servers, worker, staleness, timeout_s
        self.pending: list = []
        self.pull_s = self.push_wait_s = 0.0
        self.servers = [remote(s) for s in range(num_servers)]  # handles of the ParamServers

    def resume_step(self) -> int:
        """First step this worker has to run (0 on a fresh job; after a restore, the earliest step any
        shard has not applied from it)."""
        futs = [h.rpc_async().resume_step(self.worker) for h in self.servers]
        return min(f.wait() for f in futs) + 1

    def pull(self, reqs: dict[str, torch.Tensor], step: int = -1, want_dense: bool = False, resets=None):
        """``reqs``: table -> global unique rows [U]. Returns (table -> rows [U, K], dense flat [P] or None).
        ``resets``: as `pull_async`'s."""
        if self.staleness > 0 and step >= 0:
            t0 = time.perf_counter()
            self.servers[0].rpc_sync().wait_clock(step, self.staleness)
            self.pull_s += time.perf_counter() - t0
        return self.pull_async(reqs, step, want_dense, resets).wait()

    @property
    def can_pull_ahead(self) -> bool:
        """Whether `pull_async` may be sent a step early: not under bounded staleness, whose clock wait
        before a pull is a blocking call of its own."""
        return self.staleness <= 0

    def pull_async(
        self, reqs: dict[str, torch.Tensor], step: int = -1, want_dense: bool = False, resets=None
    ) -> PendingPull:
        """Send `pull`'s requests (one call per server) and return at once; the result's ``wait()`` gives
        what `pull` returns. Under ``staleness 0`` a server answers a pull for ``step`` only once it applied
        every worker's ``step - 1``, so a pull sent before this worker pushed ``step - 1`` returns the same
        rows as one sent after. ``resets``: table -> (global rows [E], weights [E, K]) that the servers
        start over (fresh optimiser state, not seen) before reading, after that wait."""
        parts = {n: split_by_shard(r, self.S) for n, r in reqs.items()}
        rparts = {n: (split_by_shard(r, self.S), w) for n, (r, w) in (resets or {}).items()}
        futs = []
        for s in range(self.S):
            sreq = [(n, parts[n][s][1]) for n in reqs]
            args = (sreq, want_dense, step)
            if rparts:
                args += ([(n, sp[s][1], w.index_select(0, sp[s][0])) for n, (sp, w) in rparts.items()],)
            futs.append(self.servers[s].rpc_async().pull(*args))
        return PendingPull(self, reqs, parts, futs)

    # ----------------------------------------------------------------- key map (on server 0)
    def assign(self, keys: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Server 0's key map for this worker's batch of ``step``: keys [B, F] -> (rows [B, F], evicted
        global rows [E]); a blocking round trip, so one worker's batches are mapped in its order."""
        return self.servers[0].rpc_sync().assign(keys, self.worker, step)

    def assign_async(self, keys: torch.Tensor, step: int):
        """`assign` sent at once: a future of its answer (send a worker's next batch only once the
        previous answer arrived, so that its batches reach the map in order)."""
        return self.servers[0].rpc_async().assign(keys, self.worker, step)

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """Read-only lookup in server 0's key map: keys [n, F] -> rows [n, F]."""
        return self.servers[0].rpc_sync().lookup(keys)

    def keymap_state(self) -> dict:
        """Server 0's key map: ``row_key`` [rows] int64 and ``counters``."""
        return self.servers[0].rpc_sync(timeout=0).keymap_state()

    def push(self, grads: dict[str, tuple[torch.Tensor, torch.Tensor]], dense_grad=None, step: int = -1):
        """Send the sparse gradients (table -> (global unique rows [U], grad [U, K])) and the dense one.
        Asynchronous: returns at once; `wait` blocks until the servers accepted this push."""
        self.wait()  # at most one push in flight: bounded memory, and the clock below stays truthful
        parts = {n: (r, g, split_by_shard(r, self.S)) for n, (r, g) in grads.items()}
        for s in range(self.S):
            sg = [(n, parts[n][2][s][1], parts[n][1].index_select(0, parts[n][2][s][0])) for n in grads]
            dg = None
            if dense_grad is not None:
                lo, hi = contiguous_part(dense_grad.numel(), s, self.S)
                dg = dense_grad[lo:hi]
            self.pending.append(self.servers[s].rpc_async().push(sg, dg, self.worker, step))
        if self.staleness > 0:
            self.wait()
            self.servers[0].rpc_sync().clock(self.worker, step)

    def wait(self) -> None:
        t0 = time.perf_counter()
        for f in self.pending:
            f.wait()
        self.pending = []
        self.push_wait_s += time.perf_counter() - t0

    # ----------------------------------------------------------------- job control
    def done(self) -> None:
        self.wait()
        self.servers[0].rpc_sync().worker_done(self.worker)

    def wait_all_done(self) -> None:
        self.servers[0].rpc_sync(timeout=0).wait_all_done()  # 0: no call timeout (heartbeats still run)

    def checkpoint(self, step: int) -> str:
        self.wait()
        return self.servers[0].rpc_sync().checkpoint(step)

    def dump(
        self, num_rows: dict[str, int]
    ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Assemble every table in global row order: table -> (weight [N, K], seen [N] bool); dense [P]."""
        futs = [h.rpc_async(timeout=0).dump() for h in self.servers]
        parts = [f.wait() for f in futs]
        out = {}
        for n, N in num_rows.items():
            if self.S == 1:  # already in global order: no second full-size copy
                out[n] = parts[0]["tables"][n]
                continue
            w0 = parts[0]["tables"][n][0]
            w = torch.empty(N, w0.shape[1], dtype=w0.dtype)
            seen = torch.zeros(N, dtype=torch.bool)
            for s in range(self.S):
                ws, ss = parts[s]["tables"][n]
                w[s :: self.S] = ws
                seen[s :: self.S] = ss
                parts[s]["tables"][n] = None  # free each part once copied
            out[n] = (w, seen)
        self.server_counters = [p["counters"] for p in parts]
        dense = [p["dense"] for p in parts if p["dense"] is not None]
        return out, (torch.cat(dense) if dense else torch.zeros(0))

    def finish_servers(self) -> None:
        for f in [h.rpc_async().finish() for h in self.servers]:
            f.wait()
