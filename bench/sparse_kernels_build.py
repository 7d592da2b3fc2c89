"""How to build the C row loops (`platform/sparse/rows.c`), measured: build time and loop time of the
portable build with per-CPU clones (what setup.py builds), ``-march=native``, and the x86-64 baseline alone.

The three loops at Criteo's shapes (39 fields x 100k rows of 17 floats, batch 2048, Zipf 1.2 ids): ms per
step of ``gather_split`` + ``unique_sum`` + ``update_rows`` (adagrad), 1 thread, the builds interleaved
round by round (a load change on a shared machine hits all alike). Prints one line per build.

    .venv/bin/python bench/sparse_kernels_build.py [--rounds 7] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from mariana.platform.sparse import kernels as K

BUILDS = {  # name -> extra flags; "clones" is setup.py's build (rows.c's target_clones pick the CPU's)
    "clones": [],
    "native": ["-march=native"],
    "baseline": ["-DCLONES_OFF"],
}


def build(out: Path, extra: list[str]) -> float:
    src = K.SOURCE.read_text()
    if "-DCLONES_OFF" in extra:  # the same source without the clones: the x86-64 baseline only
        src = src.replace('__attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))', "")
    c = out.with_suffix(".c")
    c.write_text(src)
    define = f'-DMARIANA_ROWS_SOURCE="{K.source_id()}"'
    flags = [f for f in extra if f != "-DCLONES_OFF"]
    t0 = time.perf_counter()
    subprocess.run(
        ["cc", *K.FLAGS, *flags, "-shared", "-fPIC", define, "-o", str(out), str(c), "-lm"], check=True
    )
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    libs, build_s = {}, {}
    for name, extra in BUILDS.items():
        build_s[name] = build(tmp / f"{name}.so", extra)
        libs[name] = K.load(tmp / f"{name}.so")
    R, F, B, W = 100_000, 39, 2048, 17
    rng = np.random.default_rng(0)
    table, acc, seen = (
        torch.randn(F * R, W) * 0.01,
        torch.zeros(F * R, W),
        torch.zeros(F * R, dtype=torch.bool),
    )
    base = np.arange(F) * R
    batches = [torch.from_numpy(((rng.zipf(1.2, (B, F)) - 1) % R + base).astype(np.int64)) for _ in range(8)]
    gw, ge = torch.randn(B, F), torch.randn(B, F, W - 1)
    ms = {n: [] for n in libs}
    for _ in range(args.rounds):
        for name, lib in libs.items():
            K.kernels = lambda lib=lib: lib  # the module's loops call kernels() for their library
            s = K.Scratch(F * R)
            t0 = time.perf_counter()
            for i in range(args.steps):
                ids = batches[i % len(batches)]
                K.gather_split(table, ids, s)
                rows, sums = K.unique_sum(ids, gw, ge, s)
                K.update_rows(table, acc, seen, rows, sums, "adagrad", 0.05, 1e-8)
            ms[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    for n, v in ms.items():
        print(
            f"{n}: build {build_s[n]:.2f} s; loops median {statistics.median(v):.2f} ms/step, rounds {[round(x, 2) for x in v]}"
        )


if __name__ == "__main__":
    main()
