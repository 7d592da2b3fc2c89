"""Serving latency/throughput benchmark: `mariana serve --pctr` against a naive FastAPI endpoint, or (with
--runtimes) `mariana serve --runtime R` for each runtime R.

    .venv/bin/python bench/serving_latency.py [--pctr RUN] [--duration 4] [--rates 100,250,500,750,1000,1500]
    .venv/bin/python bench/serving_latency.py --runtimes torch,onnxruntime [--rounds 5] [--rate 200]

Both servers run the same exported model in their own processes; the load comes from
`bench/loadgen.py` in a third process (open loop at fixed rates, bounded in time):

- single-instance requests at each rate: p50/p99 latency (from the request's due time, so a slow server
  cannot hide queueing) and error count; a rate ladder stops early once a server is clearly overloaded;
- batch requests (1000 instances, 2 connections back to back): predictions/s;
- "sustainable rate at p99 <= B": the highest tested rate at which it and every lower tested rate had no
  error and p99 <= B, for several B.

The naive endpoint is what a plain FastAPI service does: a pydantic body, ``def`` handler (thread pool),
parse + predict each request by itself, response through the response model. Without ``--pctr`` a tiny
DeepFM is trained on Frappe first (``mariana pctr train --preset debug``).
Targets (issue 6): p99 <= 10 ms at 500 req/s, >= 50k predictions/s batched, >= 3x the naive sustainable
rate at equal p99. Writes bench/results/serving_latency-cpu.json and prints one table.

--runtimes: the same model served once per runtime (``model.onnx`` exported first with `mariana export RUN
--format onnx` when missing), all servers up together and measured in interleaved rounds (A B, B A, ...): per
round single-instance requests at --rate (p50/p99) then batch requests (predictions/s); one table of every
round and the medians, bench/results/serving_runtimes-cpu.json.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from loadgen import run_process  # bench/ is on sys.path when a script here runs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
DATA = Path(os.environ.get("MARIANA_DATA", ROOT.parent / "shared" / "data"))
FRAPPE = DATA / "frappe" / "frappe.validation.libfm"
BUDGETS_MS = (10.0, 25.0, 50.0, 100.0)


# ------------------------------------------------------------------------------------- naive server
def naive_app(run: str):
    """The baseline: parse and predict inside each request, no micro-batching, default FastAPI paths."""
    import torch
    from fastapi import FastAPI
    from mariana.apps.pctr.models.predict import load_predictor
    from pydantic import BaseModel

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    pred = load_predictor(run)
    app = FastAPI()

    class Req(BaseModel):
        instances: list[str]

    class Resp(BaseModel):
        probabilities: list[float | None]
        model_version: str

    @app.post("/v1/pctr/predict", response_model=Resp)
    def predict(req: Req):
        probs, _ = pred.predict_lines(req.instances)
        return {"probabilities": probs, "model_version": pred.version}

    return app


def run_naive(run: str, port: int) -> None:
    import uvicorn

    uvicorn.run(naive_app(run), host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ------------------------------------------------------------------------------------------ helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    e = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", NO_PROXY="127.0.0.1,localhost")
    e.pop("OMP_NUM_THREADS", None)
    return e


def start(cmd: list[str], port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env(), stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            body = {"instances": ["1:1"]}
            if httpx.post(f"http://127.0.0.1:{port}/v1/pctr/predict", json=body, timeout=2).status_code < 500:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop(proc)
    raise SystemExit(f"server did not start: {log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def loadgen(url: str, body: Path, *args: str) -> dict:
    return run_process(url, body, *args, env=env())


def sustainable(rows: list[dict], budget_ms: float) -> float:
    """The highest tested rate at which that rate and every lower tested rate had no error and
    p99 <= ``budget_ms`` (a pass above a failure does not count); 0 if the lowest rate fails."""
    best = 0.0
    for r in sorted(rows, key=lambda r: r["rate"]):
        if r["errors"] or r["p99_ms"] > budget_ms:
            break
        best = r["rate"]
    return best


# ----------------------------------------------------------------------------------------- runtimes
def compare_runtimes(a, run: str, n: int, one: Path, batch: Path, tmp: Path) -> int:
    """--runtimes: one `mariana serve --runtime R` per runtime, interleaved rounds (see the module)."""
    from importlib.metadata import version

    from common import median_round, table, write_result

    runtimes = a.runtimes.split(",")
    if "onnxruntime" in runtimes and not (Path(run) / "model.onnx").is_file():
        cmd = [sys.executable, "-m", "mariana.platform.cli", "export", run, "--format", "onnx"]
        subprocess.run(cmd, cwd=ROOT, env=env(), check=True, capture_output=True)
    procs, urls, rows = [], {}, []
    try:
        for rt in runtimes:
            port = free_port()
            cmd = [sys.executable, "-m", "mariana.platform.cli", "serve", "--pctr", run, "--runtime", rt]
            procs.append(start([*cmd, "--port", str(port)], port, tmp / f"{rt}.log"))
            urls[rt] = f"http://127.0.0.1:{port}/v1/pctr/predict"
            loadgen(urls[rt], one, "--rate", "100", "--duration", "1")  # warm-up
        for i in range(a.rounds):
            for rt in runtimes if i % 2 == 0 else runtimes[::-1]:
                r = loadgen(urls[rt], one, "--rate", str(a.rate), "--duration", str(a.duration))
                b = loadgen(urls[rt], batch, "--concurrency", "2", "--duration", str(a.duration))
                rows.append({"round": i + 1, "runtime": rt, "rate": a.rate, "sent": r["sent"], "errors": r["errors"],
                             "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
                             "predictions_per_s": round(b["achieved_rps"] * n), "batch_errors": b["errors"]})  # fmt: skip
    finally:
        for proc in procs:
            stop(proc)
    keys = ("p50_ms", "p99_ms", "predictions_per_s")
    summary = {
        rt: {k: median_round([r for r in rows if r["runtime"] == rt], k)[k] for k in keys} for rt in runtimes
    }
    versions = {d: version(d) for d in ("torch", "onnx", "onnxruntime", "onnxscript")}
    payload = {"run": run, "rounds": a.rounds, "rate": a.rate, "batch": n, "duration_s": a.duration,
               "versions": versions, "load": os.getloadavg(), "rows": rows, "median": summary}  # fmt: skip
    path = write_result("serving_runtimes", payload)
    medians = [{"round": "median", "runtime": rt, "rate": a.rate, **m} for rt, m in summary.items()]
    print(table(rows + medians, ["round", "runtime", "rate", "sent", "errors", *keys, "batch_errors"]))
    print(f"load average during the run: {os.getloadavg()} (machine shared; numbers are pessimistic)")
    print(f"wrote {path}")
    print("; ".join(f"{rt}: p50 {m['p50_ms']} ms p99 {m['p99_ms']} ms, {m['predictions_per_s']} predictions/s batched"
                    for rt, m in summary.items()))  # fmt: skip
    return 0


# --------------------------------------------------------------------------------------------- main
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pctr", help="pCTR run directory (default: train a tiny DeepFM on Frappe first)")
    p.add_argument("--data", default=str(FRAPPE), help="libFM file the request records come from")
    p.add_argument("--rates", default="100,250,500,750,1000,1500", help="open-loop request rates (req/s)")
    p.add_argument("--duration", type=float, default=4.0, help="seconds of load per rate")
    p.add_argument("--batch", type=int, default=1000, help="instances per batch request")
    p.add_argument("--runtimes", help="compare these `serve --runtime` values instead (torch,onnxruntime)")
    p.add_argument("--rounds", type=int, default=5, help="--runtimes: interleaved rounds")
    p.add_argument(
        "--rate", type=float, default=200.0, help="--runtimes: single-instance requests/s per round"
    )
    p.add_argument("--naive-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.naive_server:
        run_naive(a.pctr, a.naive_server)
        return 0
    rates = [float(r) for r in a.rates.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="serving-bench-"))
    run = a.pctr
    if not run:
        run = str(tmp / "run")
        cmd = [sys.executable, "-m", "mariana.platform.cli", "pctr", "train", "--data", str(FRAPPE)]
        cmd += ["--format", "libfm", "--preset", "debug", "--model", "deepfm", "--out", run]
        subprocess.run(cmd, cwd=ROOT, env=env(), check=True, capture_output=True)
    lines = []
    with open(a.data, encoding="utf-8") as f:
        for ln in f:
            if ln.strip():
                lines.append(ln.split(None, 1)[1].strip())
            if len(lines) == a.batch:
                break
    one, batch = tmp / "one.json", tmp / "batch.json"
    one.write_text(json.dumps({"instances": lines[:1]}))
    batch.write_text(json.dumps({"instances": lines}))
    if a.runtimes:
        return compare_runtimes(a, run, len(lines), one, batch, tmp)

    servers = {
        "mariana": [sys.executable, "-m", "mariana.platform.cli", "serve", "--pctr", run],
        "naive": [sys.executable, str(Path(__file__).resolve()), "--pctr", run],
    }
    rows, summary = [], {}
    for name, cmd in servers.items():
        port = free_port()
        cmd = [*cmd, "--port", str(port)] if name == "mariana" else [*cmd, "--naive-server", str(port)]
        proc = start(cmd, port, tmp / f"{name}.log")
        url = f"http://127.0.0.1:{port}/v1/pctr/predict"
        try:
            loadgen(url, one, "--rate", "100", "--duration", "1")  # warm-up
            ladder = []
            for rate in rates:
                r = loadgen(url, one, "--rate", str(rate), "--duration", str(a.duration))
                ladder.append(r)
                rows.append({"server": name, "requests": "single", **r})
                if (
                    r["errors"] > r["sent"] // 10 or r["p99_ms"] > 2000
                ):  # overloaded: higher rates say nothing
                    break
            b = loadgen(url, batch, "--concurrency", "2", "--duration", str(a.duration))
            b["predictions_per_s"] = round(b["achieved_rps"] * len(lines))
            rows.append({"server": name, "requests": f"batch {len(lines)}", "rate": "closed x2", **b})
        finally:
            stop(proc)
        summary[name] = {
            "sustainable_rps": {f"p99<={int(bm)}ms": sustainable(ladder, bm) for bm in BUDGETS_MS},
            "predictions_per_s_batched": b["predictions_per_s"],
            "single": {
                str(int(r["rate"])): {k: r[k] for k in ("p50_ms", "p99_ms", "errors")} for r in ladder
            },
        }
    ratios = {}
    for bm in BUDGETS_MS:
        k = f"p99<={int(bm)}ms"
        m, n = summary["mariana"]["sustainable_rps"][k], summary["naive"]["sustainable_rps"][k]
        ratios[k] = round(m / n, 2) if n else (float("inf") if m else None)
    at500 = summary["mariana"]["single"].get("500", {})
    payload = {
        "run": run,
        "duration_s_per_rate": a.duration,
        "load": os.getloadavg(),
        "rows": rows,
        "summary": summary,
        "sustainable_ratio_vs_naive": ratios,
        "targets": {
            "p99_ms_at_500rps": {"target": 10.0, "measured": at500.get("p99_ms")},
            "predictions_per_s_batched": {
                "target": 50_000,
                "measured": summary["mariana"]["predictions_per_s_batched"],
            },
            "ratio_vs_naive": {"target": 3.0, "measured": ratios},
        },
    }
    from common import table, write_result

    path = write_result("serving_latency", payload)
    for r in rows:
        r.setdefault("predictions_per_s", "")
    cols = ["server", "requests", "rate", "sent", "ok", "errors", "p50_ms", "p99_ms", "achieved_rps"]
    print(table(rows, [*cols, "predictions_per_s"]))
    print(
        f"sustainable single-instance rate (no errors, p99 <= budget): "
        f"mariana {summary['mariana']['sustainable_rps']} naive {summary['naive']['sustainable_rps']}"
    )
    print(f"load average during the run: {os.getloadavg()} (machine shared; numbers are pessimistic)")
    print(f"wrote {path}")
    print(
        f"p99 at 500 req/s {at500.get('p99_ms')} ms; batched "
        f"{summary['mariana']['predictions_per_s_batched']} predictions/s; sustainable vs naive {ratios}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
