#!/usr/bin/env bash
# `make demo`: the main end-to-end jobs on the sample data, each with 2 data-parallel workers where the
# framework has them. Every step prints its headline metric last. Runs go under $RUNS (default runs/demo).
# One seed (the default, 0): `python bench/demo_spread.py` runs the measured steps with these settings over
# seeds 0, 1, 2 (the spread the README quotes).
set -euo pipefail
DATA=${DATA:-../shared/data}
RUNS=${RUNS:-runs/demo}
PY=${PY:-.venv/bin/python}
M="$PY -m mariana.platform.cli"
if [ ! -d "$DATA" ]; then echo "demo: sample data not found at $DATA (set DATA=...)" >&2; exit 2; fi
rm -rf "$RUNS"; mkdir -p "$RUNS"
step() { echo; echo "=== $*"; }

step "platform: click MLP on Frappe, 2 data-parallel workers (torchrun, gloo); test AUC on the held-out last 10 %"
# mlp train splits the file by row order: train | val (--val-fraction) | test (--test-fraction, never trained on).
$M mlp train --data "$DATA/frappe/frappe.validation.libfm" --out "$RUNS/mlp" --workers 2 --epochs 2 \
  --batch-size 256 --lr 0.01 --no-progress
$M mlp eval --model "$RUNS/mlp" --data "$DATA/frappe/frappe.validation.libfm" --split test

# --- vision (issue 4): data parallel, then model (pipeline) parallel ---------------------------------------------
step "vision: cifar-fast on 16k CIFAR-10 JPEGs read from the tar, 2 data-parallel workers, eval + classify"
$M vision train --data "$DATA/cifar10/train.tar" --eval-data "$DATA/cifar10/test-dev.tar" --out "$RUNS/vision" \
  --preset small --limit 16000 --workers 2 --no-progress
$M vision eval --model "$RUNS/vision" --data "$DATA/cifar10/test-dev.tar"
tar -xf "$DATA/cifar10/test-dev.tar" -C "$RUNS" test/cat/0000.jpg test/ship/0000.jpg
$M vision classify --model "$RUNS/vision" "$RUNS/test/cat/0000.jpg" "$RUNS/test/ship/0000.jpg"
# Model parallel: the same cifar-fast net cut into 2 pipeline stages at the block boundary that balances
# their measured compute (--stage-balance time), one process per stage; each batch of 128 flows through
# them as 4 micro-batches (1F1B schedule), so both stages work at once. One epoch over 8192 training images (64
# steps, the `small` recipe's LR schedule) is enough for the merged exported model to score far above the
# 10 % chance level on the held-out test-dev.tar, scored by the same `vision eval` as any other run.
step "vision: cifar-fast split into 2 pipeline stages (2 processes, 4 micro-batches per batch), eval on test-dev"
$M vision train --data "$DATA/cifar10/train.tar" --out "$RUNS/vision-pipeline" --preset small --limit 8192 \
  --workers 2 --model-parallel 2 --micro-batches 4 --stage-balance time --no-progress
$M vision eval --model "$RUNS/vision-pipeline" --data "$DATA/cifar10/test-dev.tar"

step "asr: connected digits from FSDD (jackson held out), acoustic DNN + CTC, 2 data-parallel workers"
# The `small` recipe of tests/test_asr_accuracy.py (~2 min): shorter runs stay in CTC's all-blank phase.
$M asr prepare --data "$DATA/fsdd/recordings" --out "$RUNS/asr-data" --test-speakers jackson --utterances 150 \
  --max-digits 5
$M asr train --data "$RUNS/asr-data" --out "$RUNS/asr" --preset small --workers 2 --no-progress
$M asr eval --model "$RUNS/asr" --data "$RUNS/asr-data/test"
# Synthetic speakers (eSpeak NG) as the unseen-speaker recipe mixes into training (`prepare --synth`): a
# few voices here, to show the step; the recipe uses 200 (apps/asr/README.md).
$M asr synth --out "$RUNS/asr-synth" --speakers 4 --takes 2

# --- pctr (issue 5): ~45 s on 2 CPU cores --------------------------------------------------------------------
step "pctr: DeepFM on Frappe, 2 parameter servers + 2 asynchronous workers (torchrun + ZeroMQ), test-split eval"
$M pctr train --data "$DATA/frappe/frappe.validation.libfm" --format libfm --out "$RUNS/pctr" --model deepfm \
  --rows-per-field 8192 --dim 8 --hidden 64,32 --servers 2 --workers 2 --epochs 2 --ckpt-every 40 --no-progress
$M pctr eval --model "$RUNS/pctr" --data "$DATA/frappe/frappe.validation.libfm" --format libfm --split test

# --- job service (issue 15): ~1 min -----------------------------------------------------------------------------
step "job service: \`mariana jobs serve\`, submit a pCTR job, watch it live, list it with its best AUC"
# The service keeps a SQLite database of jobs and their counters under --home and serves the web UI; the job
# runs as its own process group, so closing this terminal would not stop it.
JOBS_HOME="$RUNS/jobs-home"
$M jobs serve --home "$JOBS_HOME" --port 0 --slots 2 > "$RUNS/jobs-serve.log" 2>&1 &
JOBS=$!
trap 'kill $JOBS 2>/dev/null || true' EXIT
for _ in $(seq 600); do grep -q "http://" "$RUNS/jobs-serve.log" && break; sleep 0.2; done
export MARIANA_JOBS_URL=$(grep -o "http://[0-9.]*:[0-9]*" "$RUNS/jobs-serve.log" | head -1)
[ -n "$MARIANA_JOBS_URL" ] || { cat "$RUNS/jobs-serve.log"; exit 1; }
ID=$($M submit pctr train --data "$DATA/frappe/frappe.validation.libfm" --format libfm --preset frappe --epochs 3 \
  --eval-every 30 --no-progress | tail -n 1)
echo "job $ID queued; its live page (loss and validation AUC curves): $MARIANA_JOBS_URL/jobs/$ID"
$M jobs wait "$ID"
$M jobs list
kill $JOBS; wait $JOBS 2>/dev/null || true
unset MARIANA_JOBS_URL

# --- serving (issue 6): ~10 s ---------------------------------------------------------------------------------
step "serving: the pCTR model behind the REST server (uvicorn on 127.0.0.1), three click predictions"
PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
$M serve --pctr "$RUNS/pctr" --port "$PORT" --log-level warning &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT  # replaces the job service's trap
$PY - "$PORT" "$DATA/frappe/frappe.validation.libfm" <<'PYEOF'
import sys, time, httpx
port, data = sys.argv[1], sys.argv[2]
url = f"http://127.0.0.1:{port}"
for _ in range(300):  # the server loads the model before it listens
    try:
        if httpx.get(url + "/healthz").status_code == 200:
            break
    except httpx.TransportError:
        time.sleep(0.1)
rows = [line.split(maxsplit=1) for line in open(data).read().splitlines()[:3]]  # [label, features]
r = httpx.post(url + "/v1/pctr/predict", json={"instances": [feats for _, feats in rows]}).json()
if r.get("errors"):
    sys.exit(f"demo: the server rejected instances: {r['errors']}")
for (label, _), p in zip(rows, r["probabilities"]):
    print(f"label {label:>2s}  p(click) {p:.4f}")
print(f"served by model {r['model_version']}: {len(r['probabilities'])} predictions")
PYEOF
kill $SERVER; wait $SERVER 2>/dev/null || true
