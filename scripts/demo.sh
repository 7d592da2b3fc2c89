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
