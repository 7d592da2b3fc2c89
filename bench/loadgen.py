"""A small open-loop HTTP load generator (raw asyncio sockets, HTTP/1.1 keep-alive), for the serving
benchmark and the latency regression test. Run it in its own process so it does not share the server's GIL.

``python -m bench.loadgen --url http://127.0.0.1:8000/v1/pctr/predict --body-file B.json
--rate 500 --duration 5`` prints one JSON line: sent, ok, errors by status, p50/p90/p99/max latency (ms).

Open loop: request i is due at ``start + i / rate`` whatever happened to earlier ones (new connections are
opened when all are busy), so a slow server cannot slow the offered load down (no coordinated omission).
Latency is measured from the due time (``*_ms``) and from the actual send (``send_*_ms``).
``--concurrency C`` without ``--rate`` runs closed loop instead (C connections back to back: throughput).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from urllib.parse import urlsplit


def build_request(url: str, body: bytes, content_type: str = "application/json") -> tuple[str, int, bytes]:
    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"loadgen: refusing non-loopback target {host}")
    head = (
        f"POST {u.path or '/'} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n"
    )
    return host, port, head.encode() + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """-> (status, keep_alive). Reads exactly one response (Content-Length bodies)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length, keep = 0, True
    for ln in lines[1:]:
        k, _, v = ln.partition(":")
        k = k.strip().lower()
        if k == "content-length":
            length = int(v.strip())
        elif k == "connection" and v.strip().lower() == "close":
            keep = False
    if length:
        await reader.readexactly(length)
    return status, keep


class _Pool:
    def __init__(self, host: str, port: int, max_conns: int):
        self.host, self.port, self.max_conns = host, port, max_conns
        self.idle: list = []
        self.open = 0
        self.waiters: deque[asyncio.Future] = deque()

    async def get(self):
        if self.idle:
            return self.idle.pop()
        if self.open < self.max_conns:
            self.open += 1
            try:
                return await asyncio.open_connection(self.host, self.port)
            except OSError:
                self.open -= 1
                raise
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        conn = await fut
        if conn is None:  # a connection was dropped: open a replacement in its place
            self.open += 1
            try:
                return await asyncio.open_connection(self.host, self.port)
            except OSError:
                self.open -= 1
                raise
        return conn

    def put(self, conn, ok: bool) -> None:
        if not ok:
            self.open -= 1
            conn[1].close()
            conn = None
        while self.waiters:  # someone waits for a connection: hand this one over directly
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(conn)
                return
        if conn is not None:
            self.idle.append(conn)

    def close(self) -> None:
        for _, w in self.idle:
            w.close()


def _pct(sorted_ms: list[float], q: float) -> float:
    if not sorted_ms:
        return float("nan")
    i = min(len(sorted_ms) - 1, max(0, int(round(q / 100 * len(sorted_ms) + 0.5)) - 1))
    return round(sorted_ms[i], 3)


def summarize(lat_due: list[float], lat_send: list[float], statuses: dict, sent: int, wall: float) -> dict:
    a, b = sorted(lat_due), sorted(lat_send)
    ok = statuses.get(200, 0)
    return {
        "sent": sent,
        "ok": ok,
        "errors": sent - ok,
        "statuses": {str(k): v for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0]))},
        "wall_s": round(wall, 3),
        "achieved_rps": round(ok / wall, 1) if wall > 0 else 0.0,
        "p50_ms": _pct(a, 50),
        "p90_ms": _pct(a, 90),
        "p99_ms": _pct(a, 99),
        "max_ms": round(a[-1], 3) if a else float("nan"),
        "send_p50_ms": _pct(b, 50),
        "send_p99_ms": _pct(b, 99),
    }


async def run_open_loop(
    url: str, body: bytes, rate: float, duration: float, max_conns: int = 256, timeout: float = 10.0
) -> dict:
    host, port, req = build_request(url, body)
    pool = _Pool(host, port, max_conns)
    lat_due, lat_send, statuses = [], [], {}
    n = max(1, int(rate * duration))
    tasks = []

    async def one(due: float):
        t_send = time.perf_counter()
        conn = None
        ok_conn = False
        try:
            conn = await pool.get()
            t_send = time.perf_counter()
            conn[1].write(req)
            status, ok_conn = await asyncio.wait_for(_read_response(conn[0]), timeout)
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as e:
            status = type(e).__name__
        t = time.perf_counter()
        if conn is not None:
            pool.put(conn, ok_conn)
        statuses[status] = statuses.get(status, 0) + 1
        lat_due.append((t - due) * 1000)
        lat_send.append((t - t_send) * 1000)

    start = time.perf_counter() + 0.05
    for i in range(n):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(due)))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    pool.close()
    out = summarize(lat_due, lat_send, statuses, n, wall)
    out.update({"mode": "open", "rate": rate, "duration_s": duration, "connections": pool.open})
    return out


async def run_closed_loop(
    url: str, body: bytes, concurrency: int, duration: float, timeout: float = 30.0
) -> dict:
    host, port, req = build_request(url, body)
    lat, statuses = [], {}
    sent = 0
    stop_at = time.perf_counter() + duration

    async def worker():
        nonlocal sent
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as e:
            statuses[type(e).__name__] = statuses.get(type(e).__name__, 0) + 1
            return
        try:
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                writer.write(req)
                sent += 1
                try:
                    status, keep = await asyncio.wait_for(_read_response(reader), timeout)
                except (OSError, asyncio.IncompleteReadError, TimeoutError) as e:
                    statuses[type(e).__name__] = statuses.get(type(e).__name__, 0) + 1
                    return
                statuses[status] = statuses.get(status, 0) + 1
                lat.append((time.perf_counter() - t0) * 1000)
                if not keep:
                    return
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    out = summarize(lat, lat, statuses, sent, wall)
    out.update({"mode": "closed", "concurrency": concurrency, "duration_s": duration})
    return out


def run_process(url: str, body_file, *args: str, env: dict | None = None, timeout: float = 300) -> dict:
    """Run this load generator in its own process (so it does not share the server's or the caller's
    cores' event loop) against ``url`` with the request body in ``body_file``; extra ``args`` are its
    flags (``--rate``, ``--concurrency``, ``--duration``). Returns its JSON summary; raises RuntimeError
    with its stderr when it fails."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--url",
        url,
        "--body-file",
        str(body_file),
        *args,
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"loadgen failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="open/closed-loop HTTP load against a loopback server")
    p.add_argument("--url", required=True, help="http://127.0.0.1:PORT/path (loopback only)")
    p.add_argument("--body-file", required=True, help="request body (JSON) file")
    p.add_argument("--rate", type=float, default=0.0, help="requests/s (open loop); 0 = closed loop")
    p.add_argument("--concurrency", type=int, default=4, help="connections for the closed loop")
    p.add_argument("--duration", type=float, default=5.0, help="seconds of load (bounded)")
    p.add_argument("--max-conns", type=int, default=256, help="open-loop connection cap")
    a = p.parse_args(argv)
    if a.duration <= 0 or a.duration > 120:
        raise SystemExit("--duration must be in (0, 120] seconds")
    body = open(a.body_file, "rb").read()
    if a.rate > 0:
        res = asyncio.run(run_open_loop(a.url, body, a.rate, a.duration, a.max_conns))
    else:
        res = asyncio.run(run_closed_loop(a.url, body, a.concurrency, a.duration))
    print(json.dumps(res))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
