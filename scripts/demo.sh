#!/usr/bin/env bash
# `make demo`: the main end-to-end jobs on the sample data, each with 2 data-parallel workers where the
# framework has them. Every step prints its headline metric last. Runs go under $RUNS (default runs/demo).
set -euo pipefail
DATA=${DATA:-../shared/data}
RUNS=${RUNS:-runs/demo}
PY=${PY:-.venv/bin/python}
M="$PY -m mariana.platform.cli"
if [ ! -d "$DATA" ]; then echo "demo: sample data not found at $DATA (set DATA=...)" >&2; exit 2; fi
rm -rf "$RUNS"; mkdir -p "$RUNS"
step() { echo; echo "=== $*"; }

step "platform: click MLP on Frappe, 2 data-parallel workers (torchrun, gloo)"
$M mlp train --data "$DATA/frappe/frappe.validation.libfm" --out "$RUNS/mlp" --workers 2 --epochs 2 \
  --batch-size 256 --lr 0.01 --no-progress
$M mlp eval --model "$RUNS/mlp" --data "$DATA/frappe/frappe.validation.libfm"

# --- vision (issue 4): ~1.5 min on 2 CPU cores -------------------------------------------------------------
step "vision: cifar-fast on 16k CIFAR-10 JPEGs read from the tar, 2 data-parallel workers, eval + classify"
$M vision train --data "$DATA/cifar10/train.tar" --eval-data "$DATA/cifar10/test-dev.tar" --out "$RUNS/vision" \
  --preset small --limit 16000 --workers 2 --no-progress
$M vision eval --model "$RUNS/vision" --data "$DATA/cifar10/test-dev.tar"
tar -xf "$DATA/cifar10/test-dev.tar" -C "$RUNS" test/cat/0000.jpg test/ship/0000.jpg
$M vision classify --model "$RUNS/vision" "$RUNS/test/cat/0000.jpg" "$RUNS/test/ship/0000.jpg"
step "vision: mariana-cnn-32 split into 2 pipeline stages (2 processes, 4 micro-batches per batch)"
$M vision train --data "$DATA/cifar10/train.tar" --out "$RUNS/vision-pipeline" --model mariana-cnn-32 \
  --workers 2 --model-parallel 2 --micro-batches 4 --batch-size 32 --limit 1024 --max-steps 12 --log-every 4 \
  --no-progress

step "asr: connected digits from FSDD (jackson held out), acoustic DNN + CTC, 2 data-parallel workers"
# The `small` recipe of tests/test_asr_accuracy.py (~2 min): shorter runs stay in CTC's all-blank phase.
$M asr prepare --data "$DATA/fsdd/recordings" --out "$RUNS/asr-data" --test-speakers jackson --utterances 150 \
  --max-digits 5
$M asr train --data "$RUNS/asr-data" --out "$RUNS/asr" --preset small --workers 2 --no-progress
$M asr eval --model "$RUNS/asr" --data "$RUNS/asr-data/test"

# --- pctr (issue 5): ~45 s on 2 CPU cores --------------------------------------------------------------------
step "pctr: DeepFM on Frappe, 2 parameter servers + 2 asynchronous workers (torchrun + RPC), test-split eval"
$M pctr train --data "$DATA/frappe/frappe.validation.libfm" --format libfm --out "$RUNS/pctr" --model deepfm \
  --rows-per-field 8192 --dim 8 --hidden 64,32 --servers 2 --workers 2 --epochs 2 --ckpt-every 40 --no-progress
$M pctr eval --model "$RUNS/pctr" --data "$DATA/frappe/frappe.validation.libfm" --format libfm --split test

# --- serving (issue 6): ~10 s ---------------------------------------------------------------------------------
step "serving: the pCTR model behind the REST server (uvicorn on 127.0.0.1), three click predictions"
PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
$M serve --pctr "$RUNS/pctr" --port "$PORT" --log-level warning &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
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
