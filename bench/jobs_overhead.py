"""Does the job service slow training down? The MLP demo job as a plain process vs as a submitted job.

Runs ``mariana mlp train --data FRAPPE --workers 1 --epochs 2 --batch-size 256 --lr 0.01 --no-progress``
(``scripts/demo.sh``'s MLP step with 1 worker) ``--repeats`` times each way, alternating the order
(plain, service / service, plain, ...) so slow drifts of the machine hit both sides alike:

- plain: ``python -m mariana.platform.cli mlp train ...`` as a subprocess;
- service: a fresh ``mariana jobs serve --slots 1`` (temporary home) is started, the same argv is submitted
  over HTTP, the service runs it under its runner and its LogStore tails the run's files into SQLite while
  it trains; the service is stopped after the job, so the plain runs have no service beside them.

Reported: ``samples_per_s`` from each run's metrics.json (mean, standard deviation, min, max), the same as
steps/s (``steps / wall_time_s``), and the relative difference of the means (the issue's goal: <= 2 %).

Usage: ``.venv/bin/python bench/jobs_overhead.py [--repeats 5] [--data ../shared/data/frappe/...]``
Writes bench/results/jobs_overhead-cpu.json (or -gpu) and prints one table.
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

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "frappe" / "frappe.validation.libfm"


def job_argv(data: Path, out: Path, epochs: int) -> list[str]:
    return ["mlp", "train", "--data", str(data), "--out", str(out), "--workers", "1", "--epochs", str(epochs),
            "--batch-size", "256", "--lr", "0.01", "--no-progress"]  # fmt: skip


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MARIANA_JOBS_"))}
    e["PYTHONUNBUFFERED"] = "1"
    return e


def result_of(out: Path) -> dict:
    m = json.loads((out / "metrics.json").read_text())
    return {"samples_per_s": m["samples_per_s"], "steps_per_s": m["steps"] / m["wall_time_s"],
            "wall_time_s": m["wall_time_s"], "steps": m["steps"]}  # fmt: skip


def run_plain(data: Path, out: Path, epochs: int) -> dict:
    subprocess.run([sys.executable, "-m", "mariana.platform.cli", *job_argv(data, out, epochs)], cwd=ROOT,
                   env=env(), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return result_of(out)


def run_service(data: Path, out: Path, epochs: int, home: Path) -> dict:
    svc = subprocess.Popen(
        [sys.executable, "-m", "mariana.platform.cli", "jobs", "serve", "--home", str(home), "--port", "0",
         "--slots", "1"],
        cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        line = svc.stdout.readline()
        if "http://" not in line:
            raise SystemExit(f"the job service did not start: {line}{svc.stdout.read()}")
        url = "http://" + line.split("http://", 1)[1].split()[0]
        http = httpx.Client(base_url=url, timeout=60, trust_env=False)
        for _ in range(600):  # the first request waits for the CLI catalog (imports torch)
            try:
                if http.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        r = http.post("/api/jobs", json={"argv": job_argv(data, out, epochs), "cwd": str(ROOT)})
        r.raise_for_status()
        job_id = r.json()["id"]
        # Poll rarely: the bench's own requests are not part of what is measured (the LogStore's work is).
        while (job := http.get(f"/api/jobs/{job_id}").json())["state"] in ("queued", "running"):
            time.sleep(2.0)
        if job["state"] != "succeeded":
            raise SystemExit(f"the submitted job {job['state']}: {job['error']}")
        records = len(http.get(f"/api/jobs/{job_id}/metrics").json()["records"])
        return {**result_of(out), "db_records": records}
    finally:
        svc.terminate()
        svc.wait(30)


def summary(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="runs each way")
    ap.add_argument("--epochs", type=int, default=2, help="epochs per run (the demo's 2)")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the Frappe libFM file")
    args = ap.parse_args()
    if not args.data.is_file():
        raise SystemExit(f"--data {args.data}: no such file")
    runs: dict[str, list[dict]] = {"plain": [], "service": []}
    with tempfile.TemporaryDirectory(prefix="mariana-jobs-bench-") as tmp:
        tmp = Path(tmp)
        for i in range(args.repeats):
            for mode in ("plain", "service") if i % 2 == 0 else ("service", "plain"):
                out = tmp / f"{mode}-{i}"
                if mode == "plain":
                    r = run_plain(args.data, out, args.epochs)
                else:
                    r = run_service(args.data, out, args.epochs, tmp / f"home-{i}")
                runs[mode].append(r)
                print(f"run {i + 1}/{args.repeats} {mode:7}: {r['samples_per_s']:.1f} samples/s, "
                      f"{r['steps_per_s']:.2f} steps/s", file=sys.stderr, flush=True)  # fmt: skip
    stats = {
        m: {k: summary([r[k] for r in rs]) for k in ("samples_per_s", "steps_per_s")}
        for m, rs in runs.items()
    }
    diff = stats["service"]["samples_per_s"]["mean"] / stats["plain"]["samples_per_s"]["mean"] - 1
    rows = []
    for mode in ("plain", "service"):
        s, t = stats[mode]["samples_per_s"], stats[mode]["steps_per_s"]
        rows.append({"mode": mode, "runs": len(runs[mode]), "samples/s mean": f"{s['mean']:.1f}",
                     "std": f"{s['std']:.1f}", "min": f"{s['min']:.1f}", "max": f"{s['max']:.1f}",
                     "steps/s mean": f"{t['mean']:.2f}", "std ": f"{t['std']:.2f}"})  # fmt: skip
    print(table(rows, list(rows[0])))
    print(f"service vs plain (samples/s means): {100 * diff:+.2f} %  (goal: within 2 %)")
    path = write_result(
        "jobs_overhead",
        {
            "job": ["mariana", *job_argv(args.data, Path("OUT"), args.epochs)],
            "repeats": args.repeats,
            "runs": runs,
            "stats": stats,
            "service_vs_plain": diff,
        },  # fmt: skip
    )
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
