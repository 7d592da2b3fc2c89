"""Text parsing throughput (rows/s) of the click-log readers, CPU, and whether parsing keeps up with training.

Data (written once under ``--dir``):
- ``criteo``: ``--rows`` lines of Criteo TSV from `pctr_throughput.generate` (13 counts, 26 power-law
  categoricals over 1M ids per field as 8-hex-digit strings; about 1 in 5 lines with trailing empty fields
  stripped, as in copies of the real log);
- ``libfm``: the Frappe sample repeated ``--repeat`` times.

Rows (same files, same `Encoder`, the same tensors checked equal):
- ``per-line (before)``: the per-line reader this replaces: Python text I/O, chunks of 8192 lines through
  `Encoder.encode` (numpy-vectorised per chunk, one thread);
- ``blocks, T threads``: `iter_chunks` (blocks of whole lines through Arrow's string kernels on a pool of
  T threads, results in file order).

Keeping up: `mariana pctr train` (DeepFM, fp32, batch 2048, 2 epochs) on the Criteo file: epoch 1 parses the
text in the background while training, epoch 2 reads the parsed cache. Reported per epoch: samples/s and the
share of step time the step waited for its batch (the Trainer's ``data_wait_s``): near 0 means parsing is
not the bottleneck (it still shares the two cores with the step, which is why epoch 1 is slower).

Usage: ``.venv/bin/python bench/parse_throughput.py`` -> bench/results/parse_throughput-cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_result  # noqa: E402
from pctr_throughput import epoch_rates, generate, ours, per_epoch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def strip_some_trailing(path: Path, every: int = 5) -> None:
    """Drop the trailing empty fields of every ``every``-th line (real Criteo copies have such lines)."""
    lines = path.read_text().split("\n")
    for i in range(0, len(lines), every):
        if lines[i]:
            parts = lines[i].split("\t")
            parts[-1] = ""
            lines[i] = "\t".join(parts).rstrip("\t")
    path.write_text("\n".join(lines))


def per_line(path: Path, enc) -> tuple[list, object]:
    """The reader before blocks: text lines in chunks of 8192 through `Encoder.encode`."""
    from mariana.apps.pctr.data.encoding import ReadStats

    stats = ReadStats()
    out, buf, first = [], [], 1
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            buf.append(line)
            if len(buf) == 8192:
                out.append(enc.encode(buf, True, first, stats)[0])
                first += len(buf)
                buf = []
    if buf:
        out.append(enc.encode(buf, True, first, stats)[0])
    return out, stats


def blocks(path: Path, enc, threads: int) -> tuple[list, object]:
    """The block reader (`iter_chunks`) on ``threads`` threads."""
    from mariana.apps.pctr.data.encoding import ReadStats, iter_chunks

    stats = ReadStats()
    return list(iter_chunks(path, enc, stats=stats, threads=threads)), stats


def data_wait_share(run: Path) -> list[float]:
    """Share of each epoch's step time the step spent waiting for its batch (RUN/metrics.jsonl)."""
    return [w / t for w, t in per_epoch(run, "data_wait_s", per="step")]


def timed(fn, reps: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="runs/bench-parse", help="where the generated files go")
    ap.add_argument("--rows", type=int, default=300_000, help="generated Criteo lines")
    ap.add_argument("--repeat", type=int, default=5, help="copies of the Frappe sample in the libFM file")
    ap.add_argument("--frappe", default="../shared/data/frappe/frappe.validation.libfm")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (the best is reported)")
    ap.add_argument("--train", action=argparse.BooleanOptionalAction, default=True, help="the keep-up run")
    args = ap.parse_args(argv)
    from mariana.apps.pctr.data.encoding import Batch, Encoder, infer_schema

    d = Path(args.dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    criteo, libfm = d / f"criteo_{args.rows}.tsv", d / f"frappe_x{args.repeat}.libfm"
    if not criteo.is_file():
        print(f"generating {args.rows} Criteo lines into {criteo} ...", flush=True)
        generate(criteo, args.rows, 1_000_000, 1.2)
        strip_some_trailing(criteo)
    if not libfm.is_file():
        text = Path(args.frappe).read_text()
        libfm.write_text(text * args.repeat)

    rows, res = [], {}
    for fmt, path in (("criteo", criteo), ("libfm", libfm)):
        enc = Encoder(infer_schema(path, fmt, 100_000))
        t_base, (base, s0) = timed(partial(per_line, path, enc), args.reps)
        ref = Batch.cat(base)
        r = {"rows": len(ref), "per_line_rows_per_s": len(ref) / t_base}
        rows.append({"format": fmt, "reader": "per-line (before)", "rows/s": f"{len(ref) / t_base:,.0f}"})
        for threads in (1, 2):
            t, (chunks, st) = timed(partial(blocks, path, enc, threads), args.reps)
            got = Batch.cat(chunks)
            same = all(
                torch.equal(getattr(ref, k), getattr(got, k)) for k in ("ids", "vals", "dense", "labels")
            )
            if not same or st.skipped != s0.skipped:
                raise SystemExit(f"{fmt}: the block reader's tensors differ from the per-line reader's")
            r[f"blocks_{threads}t_rows_per_s"] = len(got) / t
            rows.append(
                {
                    "format": fmt,
                    "reader": f"blocks, {threads} thread{'s' * (threads > 1)}",
                    "rows/s": f"{len(got) / t:,.0f}",
                    "x before": f"{t_base / t:.2f}",
                }
            )
        r["speedup_2t"] = r["blocks_2t_rows_per_s"] / r["per_line_rows_per_s"]
        res[fmt] = r
    print(table(rows, ["format", "reader", "rows/s", "x before"]))

    if args.train:
        run = d / "train"
        ours(criteo, run, 100_000, 2048, 2, "off")
        rates = epoch_rates(run)
        wait = data_wait_share(run)
        res["train"] = {
            "epoch_samples_per_s": rates,
            "epoch_data_wait_share": wait,
            "rows_per_field": 100_000,
            "model": "deepfm fp32",
        }
        print(
            f"\ntraining (DeepFM fp32, batch 2048): epoch 1 (parsing alongside) {rates[0]:,.0f} samples/s, "
            f"step waiting for input {100 * wait[0]:.1f} % of the time; epoch 2 (parsed cache) "
            f"{rates[1]:,.0f} samples/s, {100 * wait[1]:.1f} %; parser alone (2 threads) "
            f"{res['criteo']['blocks_2t_rows_per_s']:,.0f} rows/s"
        )
    path = write_result("parse_throughput", {"results": res, "args": vars(args)})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
