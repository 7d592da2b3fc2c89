"""Training throughput (samples/s) of DeepFM on Criteo-shaped data, CPU (2 cores).

1. A generator writes ``--rows`` lines in the Criteo TSV format: 13 integer counts (geometric) and 26
   categorical fields whose ids are drawn from a power law (Zipf, exponent ``--zipf``) over
   ``--rows-per-field`` values each (default 1M, the issue's shape), written as 8-hex-digit hashes; labels
   from a logistic model.
2. ``ours``: `mariana pctr train --servers 0 --amp bf16` (DeepFM, dim 16, batch 2048, ``--epochs`` 3; the
   same code as the CLI). Reported: the steady rate (epochs >= 2, batches from the in-memory cache, i.e.
   already-parsed tensors like the plain loop's), and the whole run (epoch 1 parses the text in a
   background thread; validation excluded). ``ours_fp32`` is the same with ``--amp off``.
3. ``plain``: a plain PyTorch loop on the same shapes and already-parsed tensors: one
   ``nn.EmbeddingBag(sparse=True)`` over all fields' rows + FM + MLP, ``torch.optim.Adagrad`` on the table's
   sparse gradient (lr 0.05, the same row rule and rate as ours: the row optimiser PyTorch offers closest to
   ours) + ``Adam`` on the dense layers, batch 2048, fp32: the like-for-like reference. ``plain_bf16`` adds
   bf16 autocast to it. Labelled extra rows: ``plain_sparse_adam`` (``SparseAdam`` rows, the reference of
   earlier runs) and ``floor`` / ``floor_bf16``: the same loop without the table's own work (rows looked
   up, their gradient computed, nothing scattered or updated), i.e. what the dense layers alone cost, an
   upper bound on any step of this model on this machine. The in-process loops run interleaved
   ``--rounds`` times; each is reported by its median round.
4. ``deepctr``: DeepCTR-Torch's DeepFM (26 sparse features of ``--rows-per-field`` ids, dim 16, the 13
   counts as dense features, Adam, its ``fit``), timed on ``--deepctr-rows`` rows after a warm-up; skipped
   with a note when it is not installed (``.venv/bin/pip install deepctr-torch --no-deps``).
5. ``ps``: `mariana pctr train --servers 1 --workers W` for W = 1 and 2 (sum of the workers' samples/s).

Usage: ``.venv/bin/python bench/pctr_throughput.py`` -> bench/results/pctr_throughput-cpu.json (about 5
minutes on 2 cores; needs ~8 GB of memory at 1M rows per field). ``--target --rounds 15``: only the CPU
target, in one process (`pctr_cpu_floor.py`): the median of the per-round ratios ours / floor.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PlainDeepFM, median_round, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def generate(path: Path, rows: int, R: int, zipf: float, seed: int = 0) -> None:
    """Write a Criteo-format TSV (streamed in blocks; memory O(block))."""
    rng = np.random.default_rng(seed)
    w_field = rng.normal(0, 0.3, 26)
    with open(path, "w") as f:
        for start in range(0, rows, 50_000):
            n = min(50_000, rows - start)
            ints = rng.geometric(0.1, (n, 13)) - 1
            cats = (rng.zipf(zipf, (n, 26)) - 1) % R
            logit = -1.2 + ((cats % 7 == 0) * w_field).sum(1) + 0.05 * np.log1p(ints[:, 0])
            y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
            hexes = np.char.mod("%08x", (cats * 2654435761 + np.arange(26)) % (1 << 32))
            lines = [
                "\t".join([str(y[i]), *map(str, ints[i]), *hexes[i]]) for i in range(n)
            ]  # generator only: not a measured path
            f.write("\n".join(lines) + "\n")


def load_cats(path: Path, R: int):
    """The file parsed once: per-field local ids [N, 26], counts [N, 13] (log1p), labels [N]."""
    from mariana.apps.pctr.data.encoding import Encoder, infer_schema, load_split

    enc = Encoder(infer_schema(path, "criteo", R))
    data = load_split(path, enc, 0, None)
    cats = (data.ids[:, 13:] - torch.arange(13, 39) * R).contiguous()
    return cats, data.dense.contiguous(), data.labels.contiguous()


def plain_loop(
    cats, y, R: int, dim: int, batch: int, steps: int, bf16: bool = False, rows: str = "adagrad"
) -> dict:
    """The plain loop; ``rows`` is the table's optimiser: ``adagrad`` (``torch.optim.Adagrad`` on the sparse
    gradient, lr 0.05: the same rule and rate as our rows, the like-for-like baseline) or ``sparse_adam``
    (``torch.optim.SparseAdam``, lr 1e-3, a labelled extra row), or ``none``: the floor of any step on
    these shapes, everything but the table's own work (rows are looked up and their gradient is computed,
    but it is not scattered into the table and no row is updated)."""

    m = PlainDeepFM(26, R, dim, (256, 128), floor=rows == "none")
    sparse_p = [m.emb.weight]
    dense_p = [p for n, p in m.named_parameters() if not n.startswith("emb")]
    opts = [torch.optim.Adam(dense_p, lr=1e-3)]
    if rows == "adagrad":
        opts.append(torch.optim.Adagrad(sparse_p, lr=0.05))
    elif rows == "sparse_adam":
        opts.append(torch.optim.SparseAdam(sparse_p, lr=1e-3))
    n = len(y)
    t0, done = None, 0
    for k in range(steps + 3):
        if k == 3:  # warm-up steps excluded
            t0, done = time.perf_counter(), 0
        a = (k * batch) % max(1, n - batch)
        xb, yb = cats[a : a + batch], y[a : a + batch]
        for o in opts:
            o.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = m(xb)
        nn.functional.binary_cross_entropy_with_logits(logits.float(), yb).backward()
        for o in opts:
            o.step()
        done += len(yb)
    return {"samples_per_s": done / (time.perf_counter() - t0), "steps": steps, "batch": batch}


def deepctr_loop(cats, dense, y, R: int, dim: int, batch: int, rows: int) -> dict:
    """DeepCTR-Torch's DeepFM through its own ``fit`` (raises ImportError when it is not installed)."""
    import types

    sys.modules.setdefault("requests", types.ModuleType("requests"))  # only its version check uses it
    from deepctr_torch.inputs import DenseFeat, SparseFeat
    from deepctr_torch.models import DeepFM

    sparse = [SparseFeat(f"C{i + 1}", vocabulary_size=R, embedding_dim=dim) for i in range(26)]
    dense_f = [DenseFeat(f"I{i + 1}", 1) for i in range(13)]
    cols = sparse + dense_f
    model = DeepFM(cols, cols, task="binary", dnn_hidden_units=(256, 128), device="cpu", seed=0)
    model.compile("adam", "binary_crossentropy")

    def inp(a, b):
        d = {f"C{i + 1}": cats[a:b, i].numpy() for i in range(26)}
        d.update({f"I{i + 1}": dense[a:b, i].numpy() for i in range(13)})
        return d

    model.fit(inp(0, 2 * batch), y[: 2 * batch].numpy(), batch_size=batch, epochs=1, verbose=0)  # warm-up
    n = min(rows, len(y))
    t0 = time.perf_counter()
    model.fit(inp(0, n), y[:n].numpy(), batch_size=batch, epochs=1, verbose=0)
    return {"samples_per_s": n / (time.perf_counter() - t0), "rows": n, "batch": batch}


def cli_train(path: Path, out: Path, R: int, batch: int, epochs: int, extra: list[str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "mariana.platform.cli", "pctr", "train", "--data", str(path)]
    cmd += ["--format", "criteo", "--out", str(out), "--model", "deepfm", "--rows-per-field", str(R)]
    cmd += ["--batch-size", str(batch), "--epochs", str(epochs), "--no-progress", *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    # The timed run's tables and checkpoints run to gigabytes at a large --rows-per-field: keep only
    # the metrics the tables are read from.
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    for f in out.glob("*.safetensors"):
        f.unlink()
    return json.loads((out / "metrics.json").read_text())


def per_epoch(run: Path, key: str, per: str = "second") -> list[tuple[float, float]]:
    """(total of ``key``, seconds) of each epoch from RUN/metrics.jsonl's log records: each record covers
    the steps since the one before, at its ``step_time_s``; ``key`` is a rate per second (``per="second"``,
    e.g. samples_per_s) or per step (``per="step"``, e.g. data_wait_s)."""
    num: dict[int, float] = {}
    secs: dict[int, float] = {}
    prev = 0
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if key not in r:
            continue  # an evaluation record
        steps, prev = r["step"] - prev, r["step"]
        t = r["step_time_s"] * steps
        num[r["epoch"]] = num.get(r["epoch"], 0.0) + r[key] * (t if per == "second" else steps)
        secs[r["epoch"]] = secs.get(r["epoch"], 0.0) + t
    return [(num[e], secs[e]) for e in sorted(secs)]


def ps_rate(run: Path, batch: int, workers: int) -> float:
    """Samples/s of a parameter-server run's second half (epoch 2 of 2: parsing done, batches from the
    cache), summed over its workers, from RUN/counters/worker-W.jsonl (cumulative samples/s per record)."""
    total = 0.0
    for k in range(workers):
        recs = [json.loads(x) for x in (run / "counters" / f"worker-{k}.jsonl").read_text().splitlines()]
        recs = [r for r in recs if "samples_per_s" in r and "loss" in r]
        last = recs[-1]["step"]
        a, b = next(r for r in recs if r["step"] > last // 2 + 10), recs[-1]
        ta, tb = (r["step"] * batch / r["samples_per_s"] for r in (a, b))
        total += (b["step"] - a["step"]) * batch / (tb - ta)
    return total


def ps_train(path: Path, out: Path, R: int, batch: int, workers: int) -> dict:
    """1 server + ``workers`` workers for 2 epochs, fp32, trained like `ours` (no regularisation, no
    validation between epochs): {"samples_per_s": epoch 2's rate (`ps_rate`), "wall_s": the job's}."""
    flags = ["--servers", "1", "--workers", str(workers), "--l2-emb", "0", "--eval-every", "0"]
    cli_train(path, out, R, batch, 2, [*flags, "--early-stop", "0", "--log-every", "10"])
    wall = json.loads((out / "counters.json").read_text())["wall_s"]
    return {"samples_per_s": ps_rate(out, batch, workers), "wall_s": wall}


def epoch_rates(run: Path) -> list[float]:
    """Training samples/s of each epoch (samples over seconds of its log intervals)."""
    return [n / t for n, t in per_epoch(run, "samples_per_s")]


def ours(path: Path, out: Path, R: int, batch: int, epochs: int, amp: str) -> dict:
    # Like the plain loop: no regularisation, no validation between epochs, every epoch trained.
    extra = ["--amp", amp, "--l2-emb", "0", "--eval-every", "0", "--early-stop", "0"]
    m = cli_train(path, out, R, batch, epochs, extra)
    rates = epoch_rates(out)
    steady = rates[1:] or rates
    return {
        "samples_per_s": sum(steady) / len(steady),  # epochs >= 2: from the in-memory cache
        "whole_run_samples_per_s": m["samples_per_s"],
        "epoch_samples_per_s": rates,
        "val_auc": m["val_auc"],
        "wall_s": m["wall_time_s"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="runs/bench-criteo-1m/criteo_synth.tsv", help="generated file")
    ap.add_argument("--rows", type=int, default=300_000, help="generated lines (if --data is missing)")
    ap.add_argument("--rows-per-field", type=int, default=1_000_000, help="hash space per field")
    ap.add_argument("--zipf", type=float, default=1.2, help="power-law exponent of the ids")
    ap.add_argument("--batch", type=int, default=2048, help="batch size")
    ap.add_argument("--epochs", type=int, default=3, help="epochs of our runs (the first parses the text)")
    ap.add_argument("--plain-steps", type=int, default=150, help="timed steps of each plain loop")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of our runs and of the plain loops, interleaved (each reported by its median round)",
    )
    ap.add_argument("--deepctr-rows", type=int, default=20480, help="rows DeepCTR-Torch is timed on")
    ap.add_argument("--ps", default="1,2", help="worker counts of the parameter-server runs ('' skips)")
    ap.add_argument(
        "--target",
        action="store_true",
        help="only the CPU target (bench/pctr_cpu_floor.py: our CLI step vs the dense-layers floor and the "
        "plain loop in one process, blocks of --block steps interleaved over --rounds rounds, fp32 and bf16)",
    )
    ap.add_argument("--block", type=int, default=5, help="--target: timed steps of each loop per round")
    ap.add_argument("--device", default="cpu", help="cuda: the in-process comparison of bench/pctr_device.py")
    ap.add_argument("--in-process", action="store_true", help="bench/pctr_device.py's comparison on --device")
    ap.add_argument("--dim", type=int, default=16, help="--in-process: embedding dim")
    ap.add_argument("--hidden", default="512,256", help="--in-process: MLP widths")
    ap.add_argument("--steps", type=int, default=30, help="--in-process: timed steps per round")
    ap.add_argument("--compile", action="store_true", help="--in-process: also the torch.compile'd step")
    args = ap.parse_args(argv)
    if args.device != "cpu" or args.in_process:
        from pctr_device import device_rounds

        res = device_rounds(args)
        out = write_result("pctr_device", {"benchmark": "pctr_device", "setup": vars(args), "results": res})
        print(f"results in {out}")
        return 0
    torch.set_num_threads(2)
    if args.target:
        from pctr_cpu_floor import breakdown, target_rounds

        R = args.rows_per_field
        res = target_rounds(R, args.batch, args.zipf, args.rounds, args.block, ["off", "bf16"])
        res["breakdown_bf16"] = breakdown(R, args.batch, args.zipf, "bf16")
        out = write_result(
            "pctr_throughput", {"benchmark": "pctr_throughput", "setup": vars(args), "results": res}
        )
        print(f"results in {out}")
        return 0
    path = Path(args.data)
    path.parent.mkdir(parents=True, exist_ok=True)
    R = args.rows_per_field
    if not path.is_file():
        print(f"generating {args.rows} lines into {path} ...", flush=True)
        generate(path, args.rows, R, args.zipf)
    res: dict = {}
    rows = [("ours (bf16 autocast)", "ours"), ("ours (fp32)", "ours_fp32")]
    # our runs interleaved over --rounds rounds too, each reported by its median round
    ours_rounds: dict[str, list[dict]] = {"ours": [], "ours_fp32": []}
    for _ in range(args.rounds):
        ours_rounds["ours"].append(ours(path, path.parent / "ours", R, args.batch, args.epochs, "bf16"))
        ours_rounds["ours_fp32"].append(
            ours(path, path.parent / "ours-fp32", R, args.batch, args.epochs, "off")
        )
    for key, rs in ours_rounds.items():
        res[key] = median_round(rs, "samples_per_s")
    ps_rows = []
    # the parameter-server runs first: the plain loops below hold the tables in this process
    for w in filter(None, args.ps.split(",")):
        # epoch 2, as `ours` (epochs >= 2)
        res[f"ps_s1_w{w}"] = ps_train(path, path.parent / f"ps-w{w}", R, args.batch, int(w))
        ps_rows.append((f"PS 1 server, {w} worker(s), fp32", f"ps_s1_w{w}"))
    cats, dense, y = load_cats(path, R)
    # the in-process loops interleaved over --rounds rounds, each reported by its median round: on a
    # shared machine a slow moment then costs one round of every loop rather than all of one loop
    loops = {
        "plain": dict(),
        "plain_bf16": dict(bf16=True),
        "plain_sparse_adam": dict(rows="sparse_adam"),
        "floor": dict(rows="none"),
        "floor_bf16": dict(bf16=True, rows="none"),
    }
    rounds: dict[str, list[dict]] = {k: [] for k in loops}
    for _ in range(args.rounds):
        for key, kw in loops.items():
            rounds[key].append(plain_loop(cats, y, R, 16, args.batch, args.plain_steps, **kw))
    for key, rs in rounds.items():
        res[key] = median_round(rs, "samples_per_s")
    rows += [
        ("plain loop, Adagrad rows (fp32)", "plain"),
        ("plain loop + bf16 autocast", "plain_bf16"),
        ("plain loop, SparseAdam rows", "plain_sparse_adam"),
        ("floor: dense layers only, fp32", "floor"),
        ("floor: dense layers only, bf16", "floor_bf16"),
    ]
    try:
        res["deepctr"] = deepctr_loop(cats, dense, y, R, 16, args.batch, args.deepctr_rows)
        rows.append(("DeepCTR-Torch DeepFM", "deepctr"))
    except ImportError as e:
        res["deepctr"] = {"error": f"DeepCTR-Torch not installed ({e})"}
    del cats, dense, y
    rows += ps_rows
    base = res["plain"]["samples_per_s"]
    # Headline ratios compare like with like: the same precision on both sides.
    res["fp32_ours_vs_plain"] = res["ours_fp32"]["samples_per_s"] / base
    res["bf16_ours_vs_plain"] = res["ours"]["samples_per_s"] / res["plain_bf16"]["samples_per_s"]
    # our bf16 whole run (with parsing) against the plain loop of the same precision, as the table prints it
    res["ours_whole_run_vs_plain_bf16"] = (
        res["ours"]["whole_run_samples_per_s"] / res["plain_bf16"]["samples_per_s"]
    )
    # How far any step of this model could go on this machine: the dense layers alone vs the plain loop.
    res["floor_vs_plain_fp32"] = res["floor"]["samples_per_s"] / base
    res["floor_vs_plain_bf16"] = res["floor_bf16"]["samples_per_s"] / res["plain_bf16"]["samples_per_s"]
    if "ps_s1_w1" in res:  # the cluster framework's cost: both fp32, epochs >= 2, the same batch
        res["ps_s1_w1_vs_ours_fp32"] = res["ps_s1_w1"]["samples_per_s"] / res["ours_fp32"]["samples_per_s"]
    if "samples_per_s" in res["deepctr"]:
        res["ours_vs_deepctr"] = res["ours"]["samples_per_s"] / res["deepctr"]["samples_per_s"]
    # each row against the plain loop of its own precision
    bf16_rows, base_bf16 = {"ours", "plain_bf16", "floor_bf16"}, res["plain_bf16"]["samples_per_s"]
    print(f"{'':32s} {'samples/s':>10s} {'vs plain, same precision':>25s}")
    for label, key in rows:
        r = res[key]["samples_per_s"]
        print(f"{label:32s} {r:10.0f} {r / (base_bf16 if key in bf16_rows else base):24.2f}x")
    o = res["ours"]
    w = o["whole_run_samples_per_s"]
    print(f"{'ours bf16, whole run w/ parsing':32s} {w:10.0f} {res['ours_whole_run_vs_plain_bf16']:24.2f}x")
    print(f"val AUC: ours bf16 {o['val_auc']:.4f}, ours fp32 {res['ours_fp32']['val_auc']:.4f}")
    if "ps_s1_w1_vs_ours_fp32" in res:
        print(f"1 server + 1 worker / one process, fp32: {res['ps_s1_w1_vs_ours_fp32']:.2f}x")
    path_out = write_result(
        "pctr_throughput", {"benchmark": "pctr_throughput", "setup": vars(args), "results": res}
    )
    print(f"results in {path_out}")
    print(
        f"dense layers alone / plain, same precision: {res['floor_vs_plain_fp32']:.2f}x fp32, "
        f"{res['floor_vs_plain_bf16']:.2f}x bf16 (no step of this model can beat these ratios here)"
    )
    print(
        f"ours/plain, same precision: {res['fp32_ours_vs_plain']:.2f}x fp32, {res['bf16_ours_vs_plain']:.2f}x bf16"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
