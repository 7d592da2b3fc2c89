"""1 server + 1 worker against one process (issue 42, point 4): steady rate, CPU-seconds and wire bytes per
sample, and where a parameter-server step's time goes.

``--rows`` (200,000) generated Criteo lines (bench/pctr_throughput.py's generator: 26 power-law categorical
fields, 13 counts), `mariana pctr train --format criteo --model deepfm --no-progress` with ``--epochs 1``
and ``--epochs 4``, one process (``--servers 0``), ``--servers 1 --workers 1``, and one process on one
thread (``OMP_NUM_THREADS=1``: every process of a 1x1 job runs one intra-op thread, so this is the most its
worker, which runs the dense layers alone, could reach), interleaved for ``--rounds`` rounds. Per run and side:
- steady rate = 3 x train lines (80 % of ``--rows``) / the wall time the 3 extra epochs add;
- CPU-seconds per sample = the CPU time the 3 extra epochs add, summed over every process of the job
  (``getrusage(RUSAGE_CHILDREN)``: torchrun waits for its processes, so theirs count), / 3 x train lines;
- wire bytes per sample (1x1) = the server's transport bytes in + out the 3 extra epochs add / samples;
- the 4-epoch 1x1 run's time split: the worker's wait for rows (``pull_s``) and for push acknowledgements
  (``push_wait_s``), the server's time in ``pull`` and ``push`` (its row reads and updates), its
  (de)serialisation (``codec_s``), and the rest of the worker's wall time (its own compute and loading).
The median round of each side is reported. On a machine shared with other work the ratio says little:
the load average is recorded beside it.

Usage: ``.venv/bin/python bench/ps_speed.py [--rounds 5]`` -> bench/results/ps_speed-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_result  # noqa: E402
from pctr_throughput import generate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def train(data: Path, out: Path, epochs: int, extra: list[str], env: dict | None = None) -> dict:
    """One `pctr train` run: its wall and CPU seconds (all its processes), and the 1x1 job's counters."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "mariana.platform.cli", "pctr", "train", "--data", str(data), "--format"]
    cmd += ["criteo", "--model", "deepfm", "--no-progress", "--out", str(out), "--epochs", str(epochs)]
    cmd += [*extra, "--early-stop", "0"]  # every epoch runs: the extra epochs are the measured work
    c0, t0 = cpu_s(), time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    got = {"wall_s": wall, "cpu_s": cpu}
    if (out / "counters.json").is_file():
        got["counters"] = json.loads((out / "counters.json").read_text())
        recs = [json.loads(x) for x in (out / "counters" / "worker-0.jsonl").read_text().splitlines() if x]
        got["worker"] = [r for r in recs if "pull_s" in r][-1]  # the last step record: the run's waits
    shutil.rmtree(out, ignore_errors=True)
    return got


def side(one: dict, four: dict, samples: float) -> dict:
    """The steady figures of one side from its 1- and 4-epoch runs."""
    out = {
        "steady_samples_per_s": round(samples / (four["wall_s"] - one["wall_s"])),
        "cpu_s_per_ksample": round(1e3 * (four["cpu_s"] - one["cpu_s"]) / samples, 3),
    }
    if "counters" in four:
        s1, s4 = (r["counters"]["servers"]["server-0"] for r in (one, four))
        wire = lambda s: s.get("transport_bytes_in", 0) + s.get("transport_bytes_out", 0)  # noqa: E731
        out["wire_bytes_per_sample"] = round((wire(s4) - wire(s1)) / samples)
        w = four["worker"]
        split = {
            "job_wall_s": round(four["wall_s"], 2),
            "worker_wait_rows_s": round(w.get("pull_s", 0.0), 2),
            "worker_wait_push_ack_s": round(w.get("push_wait_s", 0.0), 2),
            "server_pull_s": round(s4.get("transport_pull_s", 0.0), 2),
            "server_push_update_s": round(s4.get("transport_push_s", 0.0), 2),
            "server_codec_s": round(s4.get("transport_codec_s", 0.0), 2),
        }
        out["time_split_4_epochs"] = split
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--rows-per-field", type=int, default=1 << 16, help="the generator's ids per field")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-ps-speed")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / f"criteo_{args.rows}.tsv"
    if not data.is_file():
        generate(data, args.rows, args.rows_per_field, 1.2)
    samples = 3 * 0.8 * args.rows  # the 3 extra epochs over the 80 % train split
    # a third side: one process on one thread, the most a one-thread worker could reach (every process of
    # a 1x1 job has one intra-op thread; the dense layers, most of a step, run on the worker alone)
    sides = {
        "one_process": (["--servers", "0"], {}),
        "1server_1worker": (["--servers", "1", "--workers", "1"], {}),
        "one_process_1_thread": (["--servers", "0"], {"OMP_NUM_THREADS": "1"}),
    }
    rounds: dict[str, list[dict]] = {k: [] for k in sides}
    for r in range(args.rounds):
        for name, (flags, env) in sides.items():
            runs = [train(data, args.work / f"{name}-e{e}", e, flags, env) for e in (1, 4)]
            rounds[name].append(side(*runs, samples))
            print(f"round {r + 1} {name}: {rounds[name][-1]}", flush=True)
    best = {}
    for name, rs in rounds.items():
        rs = sorted(rs, key=lambda x: x["steady_samples_per_s"])
        best[name] = {**rs[(len(rs) - 1) // 2], "rounds": [x["steady_samples_per_s"] for x in rounds[name]]}

    def ratio_of(a: str, b: str) -> float:
        pairs = zip(rounds[a], rounds[b], strict=True)
        return statistics.median(x["steady_samples_per_s"] / y["steady_samples_per_s"] for x, y in pairs)

    ratio = ratio_of("1server_1worker", "one_process")
    ceiling = ratio_of("one_process_1_thread", "one_process")
    overhead = ratio_of("1server_1worker", "one_process_1_thread")
    rows = [{"side": k, **{c: v.get(c, "") for c in list(v)[:3]}} for k, v in best.items()]
    print(table(rows, ["side", "steady_samples_per_s", "cpu_s_per_ksample", "wire_bytes_per_sample"]))
    print("1x1 time split (4 epochs):", best["1server_1worker"].get("time_split_4_epochs"))
    load = os.getloadavg()[0]
    print(f"median per-round ratios: 1x1 / one process {ratio:.2f}; one process on 1 thread / on "
          f"{os.cpu_count()} threads {ceiling:.2f} (the 1x1's ceiling); 1x1 / one process on 1 thread "
          f"{overhead:.2f} (what the servers cost the worker); load average {load:.1f}")  # fmt: skip
    path = write_result(
        "ps_speed",
        {"rows": args.rows, "rounds": args.rounds, "loadavg_1m": load, "ratio_median": round(ratio, 3),
         "ratio_1_thread_over_one_process": round(ceiling, 3), "ratio_1x1_over_1_thread": round(overhead, 3),
         "sides": best},
    )  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
