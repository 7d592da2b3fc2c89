"""Dynamic ids vs hashing at equal memory on the drifting click logs (`mariana pctr drift-logs`).

Both id schemes get the same table: ``--rows-per-field R`` rows per field (one of them the OOV row), so the
same memory for weights and row-optimiser state. Hashing spreads every value of a field over its R - 1 rows
(ids share rows once a field has more values); ``--ids dynamic`` gives the R - 1 rows to the ids seen at
least ``--admit-after`` times and evicts the coldest (LFU or LRU) when new ones arrive. The map itself
adds 22.6 bytes per table row and its count-min sketch (4 MiB by default; ``map_memory_mb``).

Protocol (the production loop): day 1 trains a fresh model for one epoch; each later day d continues from
day d - 1's run (``--init-from PREV --init-train-state``: weights, id map, row and dense optimiser state)
for one epoch over day d; every day's model is scored on the next day's file (the next-day AUC / logloss
of ``mariana pctr eval``). Reported: the mean over the scored days, the per-day values, the id map's
counters after the last day, the training rate, and the parsing rate of a day file with and without the
map (``parse``: text -> keys/rows; ``parse+map``: plus `IdMap.assign` per 512-row batch, as training does).

    .venv/bin/python bench/pctr_dynamic_ids.py --rows 256 1024 4096   # the README's table (7 days x 100k)
    .venv/bin/python bench/pctr_dynamic_ids.py --rows-per-day 20000 --rows 512   # quick

Writes bench/results/pctr_dynamic_ids-cpu.json (machine, versions, date, settings, every number).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_result  # noqa: E402


def schemes(admit: int) -> list[dict]:
    return [
        {"name": "hash", "ids": "hash"},
        {"name": f"dynamic-lfu-a{admit}", "ids": "dynamic", "evict": "lfu", "admit_after": admit},
        {"name": f"dynamic-lru-a{admit}", "ids": "dynamic", "evict": "lru", "admit_after": admit},
        {"name": "dynamic-lfu-a1", "ids": "dynamic", "evict": "lfu", "admit_after": 1},
    ]


def train_days(days: list[Path], work: Path, scheme: dict, args) -> dict:
    """One-epoch incremental training over ``days``; each day's model scored on the next day."""
    from mariana.apps.pctr.configs import PctrConfig
    from mariana.apps.pctr.evaluate import evaluate_run
    from mariana.apps.pctr.train import train_local

    per_day, rates, prev, t0 = [], [], None, time.perf_counter()
    final = {}
    for d, day in enumerate(days):
        out = work / f"{scheme['name']}-R{args.rows}-day{d + 1}"
        kw = {k: v for k, v in scheme.items() if k != "name"}
        cfg = PctrConfig(
            data=str(day), format="criteo", out=str(out), model=args.model, dim=args.dim, epochs=1,
            split="1,0,0", batch_size=args.batch_size, rows_per_field=args.rows, seed=args.seed, progress=False,
            early_stop=0, eval_every=0, **kw,
            **({"init_from": str(prev), "init_train_state": True} if prev is not None else {}),
        )  # fmt: skip
        cfg.validate()
        final = train_local(cfg)
        rates.append(final["samples_per_s"])
        if d + 1 < len(days):
            r = evaluate_run(str(out), str(days[d + 1]), out=out / "next-day.json")
            per_day.append(
                {"trained_on": d + 1, "scored_on": d + 2, "auc": r["auc"], "logloss": r["logloss"]}
            )
        if prev is not None:
            shutil.rmtree(prev)
        prev = out
    aucs = [p["auc"] for p in per_day]
    lls = [p["logloss"] for p in per_day]
    res = {
        "scheme": scheme["name"],
        "rows_per_field": args.rows,
        "next_day_auc": sum(aucs) / len(aucs),
        "next_day_logloss": sum(lls) / len(lls),
        "per_day": per_day,
        "train_samples_per_s": sum(rates) / len(rates),
        "wall_s": time.perf_counter() - t0,
        "ids": final.get("ids"),
    }
    shutil.rmtree(prev)
    return res


def parse_rates(day: Path, rows: int, admit: int, repeats: int = 3) -> dict:
    """Rows/s of parsing a day file to rows (hash) / keys (dynamic), and of parsing + `IdMap.assign` of
    512-row batches (the map's work in training). Best of ``repeats``."""
    from mariana.apps.pctr.data.encoding import Encoder, infer_schema, iter_batches, iter_chunks
    from mariana.apps.pctr.ids.idmap import IdMap

    out = {}
    for name in ("hash", "dynamic", "dynamic+map"):
        schema = infer_schema(day, "criteo", rows)
        schema.ids = "hash" if name == "hash" else "dynamic"
        best = 0.0
        for _ in range(repeats):
            enc = Encoder(schema)
            m = IdMap(schema.num_fields, rows, admit) if name == "dynamic+map" else None
            t, n = time.perf_counter(), 0
            for b in iter_batches(iter_chunks(day, enc), 512):
                if m is not None:
                    m.assign(b.ids.numpy())
                n += len(b)
            best = max(best, n / (time.perf_counter() - t))
        out[name] = round(best)
    # the map alone, on keys already parsed
    schema = infer_schema(day, "criteo", rows)
    schema.ids = "dynamic"
    keys = [b.ids.numpy() for b in iter_batches(iter_chunks(day, Encoder(schema)), 512)]
    best = 0.0
    for _ in range(repeats):
        m = IdMap(schema.num_fields, rows, admit)
        t = time.perf_counter()
        for k in keys:
            m.assign(k)
        best = max(best, sum(map(len, keys)) / (time.perf_counter() - t))
    out["map_only"] = round(best)
    out["map_memory_mb"] = round(IdMap(schema.num_fields, rows, admit).memory_bytes() / 2**20, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--days", type=int, default=7)
    ap.add_argument("--rows-per-day", type=int, default=100_000)
    ap.add_argument("--rows", type=int, nargs="+", default=[1024, 4096], help="--rows-per-field values")
    ap.add_argument("--model", default="fm")
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--admit-after", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schemes", default="", help="comma-separated scheme names to run (default: all)")
    ap.add_argument("--work", default="", help="scratch folder (default: a temporary one, removed)")
    ap.add_argument(
        "--reference",
        type=int,
        default=65536,
        help="also train hashing with this many rows per field (few collisions: what the ids can give); 0: no",
    )
    args = ap.parse_args()

    import torch
    from mariana.apps.pctr.data.drift import DriftSettings, generate

    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="pctr-dyn-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "days"
    settings = DriftSettings(days=args.days, rows_per_day=args.rows_per_day, seed=args.seed)
    if not (data / f"day-{args.days:02d}.tsv").exists():
        generate(data, settings)
    days = sorted(data.glob("day-*.tsv"))[: args.days]
    want = set(filter(None, args.schemes.split(",")))
    results = []
    for rows in args.rows:
        args.rows = rows
        for s in schemes(args.admit_after):
            if want and s["name"] not in want:
                continue
            r = train_days(days, work, s, args)
            results.append(r)
            print(
                f"R={rows:>6} {r['scheme']:>16}: next-day AUC {r['next_day_auc']:.4f} logloss "
                f"{r['next_day_logloss']:.4f}  {r['train_samples_per_s']:,.0f} samples/s",
                flush=True,
            )
    if args.reference:
        args.rows = args.reference
        r = train_days(days, work, {"name": "hash-reference", "ids": "hash"}, args)
        results.append(r)
        print(f"R={args.reference:>6}   hash-reference: next-day AUC {r['next_day_auc']:.4f}", flush=True)
        args.rows = results[0]["rows_per_field"] if results else args.reference
    rates = parse_rates(days[0], args.rows, args.admit_after)
    rows_tbl = [
        {
            "R": r["rows_per_field"],
            "ids": r["scheme"],
            "next-day AUC": f"{r['next_day_auc']:.4f}",
            "logloss": f"{r['next_day_logloss']:.4f}",
            "admitted": (r["ids"] or {}).get("ids_admitted", "-"),
            "evicted": (r["ids"] or {}).get("ids_evicted", "-"),
            "OOV lookups": (r["ids"] or {}).get("ids_oov_lookups", "-"),
            "train samples/s": f"{r['train_samples_per_s']:,.0f}",
        }
        for r in results
    ]
    cols = ["R", "ids", "next-day AUC", "logloss", "admitted", "evicted", "OOV lookups", "train samples/s"]
    print(table(rows_tbl, cols))
    print(
        f"parsing {days[0].name} (R={args.rows}): hash {rates['hash']:,} rows/s, dynamic keys "
        f"{rates['dynamic']:,} rows/s, keys + map {rates['dynamic+map']:,} rows/s; map alone "
        f"{rates['map_only']:,} rows/s, {rates['map_memory_mb']} MiB"
    )
    for r in results:
        if r["ids"]:
            r["ids"] = {k: v for k, v in r["ids"].items() if k != "ids_rows_in_use_per_field"} | {
                "rows_in_use_per_field": r["ids"]["ids_rows_in_use_per_field"]
            }
    path = write_result(
        "pctr_dynamic_ids",
        {
            "command": "python " + " ".join(sys.argv),
            "settings": {
                **vars(args),
                "rows": sorted({r["rows_per_field"] for r in results}),
                "parse_rows_per_field": args.rows,
                "drift": vars(settings),
            },
            "results": results,
            "parse_rows_per_s": rates,
        },
    )
    print(f"wrote {path}")
    if not args.work:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
