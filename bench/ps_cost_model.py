"""Parameter-server cost model on the ZeroMQ transport: two measured inputs, a PREDICTION for larger clusters.

Inputs (bench/ps_speed.py's result, ``bench/results/ps_speed-cpu.json``, measured on this machine):
- ``c``: CPU-seconds per sample of the 1 server + 1 worker job, summed over its processes (the worker's
  compute, (de)serialisation, the transport's threads and the server's row and dense updates); and the
  one-process job's ``c1`` for reference;
- ``b``: bytes on the wire per sample (the server's transport bytes in + out: ids, rows, gradients, the
  dense vector, headers).

Model of S servers + W workers spread evenly over N machines of ``--cores`` cores and ``--link-gbps`` links
(full duplex): every process's work per sample is what it is in the 1x1 job (the rows a sample touches
are pulled and pushed once, whichever server holds them), so
- compute bound: N x cores / c samples/s (every core busy; the job's processes share them);
- link bound: a machine sends and receives the bytes of its samples that go to servers on other machines,
  a share (1 - 1/N) of ``b``, split between its two directions: N x link bytes/s x 2 / ((1 - 1/N) b);
- samples/s = the smaller. PREDICTED efficiency = samples/s / (N x the one-machine prediction).
Ignored (so the predictions are upper bounds): latency (pull-ahead hides one round trip per step),
stragglers, server hot spots under a skewed key distribution, and a switch's own limits.
The model is checked on this machine (N = 1, its cores) against the measured 1x1 steady rate. It assumes
every core busy; a 1x1 job on 2 cores keeps one core mostly idle (its worker runs the dense layers on one
thread, its server's updates are a small share), so there the model/measured column is well above 1.

Usage: ``python bench/ps_cost_model.py [--inputs bench/results/ps_speed-cpu.json]`` (instant; run
bench/ps_speed.py first) -> bench/results/ps_cost_model-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, table, write_result  # noqa: E402


def predict(c: float, b: float, N: int, cores: int, link_gbps: float) -> float:
    """samples/s of a job spread over N machines (see the top): ``c`` CPU-s/sample, ``b`` bytes/sample."""
    compute = N * cores / c
    if N == 1:
        return compute
    return min(compute, N * link_gbps * 1e9 / 8 * 2 / ((1 - 1 / N) * b))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=Path, default=RESULTS / "ps_speed-cpu.json")
    ap.add_argument("--cores", type=int, default=16, help="cores per machine in the predictions")
    ap.add_argument("--link-gbps", type=float, default=25.0, help="assumed link of each machine, Gbit/s")
    args = ap.parse_args(argv)
    got = json.loads(args.inputs.read_text())
    ps, one = got["sides"]["1server_1worker"], got["sides"]["one_process"]
    c, c1 = ps["cpu_s_per_ksample"] / 1e3, one["cpu_s_per_ksample"] / 1e3
    b = ps["wire_bytes_per_sample"]
    here = os.cpu_count() or 1
    model_here = predict(c, b, 1, here, args.link_gbps)
    check = [
        {"config": f"1 server, 1 worker, this machine ({here} cores)", "measured": ps["steady_samples_per_s"],
         "model": round(model_here), "model/measured": round(model_here / ps["steady_samples_per_s"], 2)}
    ]  # fmt: skip
    per_machine = predict(c, b, 1, args.cores, args.link_gbps)
    preds = []
    for N in (1, 4, 16, 64):
        p = predict(c, b, N, args.cores, args.link_gbps)
        preds.append(
            {
                "machines": N,
                "PREDICTED samples/s": round(p),
                "PREDICTED efficiency": round(p / (N * per_machine), 2),
            }
        )
    print(f"inputs ({args.inputs.name}, load average {got.get('loadavg_1m', float('nan')):.1f} when measured): "
          f"{1e6 * c:.1f} CPU-us/sample (1x1 job; one process: {1e6 * c1:.1f}), {b} wire bytes/sample")  # fmt: skip
    print(table(check, ["config", "measured", "model", "model/measured"]))
    print(f"\nPREDICTION ({args.cores} cores per machine, {args.link_gbps:g} Gbit/s links, upper bounds):")
    print(table(preds, ["machines", "PREDICTED samples/s", "PREDICTED efficiency"]))
    path = write_result(
        "ps_cost_model",
        {"benchmark": "ps_cost_model", "inputs": {"cpu_s_per_sample": c, "cpu_s_per_sample_one_process": c1,
         "wire_bytes_per_sample": b, "from": got["machine"]}, "cores": args.cores, "link_gbps": args.link_gbps,
         "check_on_this_machine": check, "prediction": preds},
    )  # fmt: skip
    print(f"results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
