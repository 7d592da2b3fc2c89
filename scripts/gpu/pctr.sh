#!/usr/bin/env bash
# pCTR on one GPU (issue 32): our one-process fixed-shape step against the like-for-like plain loop
# (nn.EmbeddingBag sparse + Adagrad rows + Adam, same fields, dims, MLP, inputs on the GPU), interleaved
# rounds, at Criteo scale (26 fields x 1M rows, dim 16, MLP 429-512-256-1, batch 8192; generated ids).
# Then the same with torch.compile(fullgraph=True) and a CUDA-graph capture check of the step.
# Writes $OUT/pctr_device.json (eager) and $OUT/pctr_device_compiled.json. About 2 minutes on an H200.
# CPU smoke test: DEVICE=cpu ROWS=1000 BATCH=64 STEPS=2 OUT=/tmp/x scripts/gpu/pctr.sh
set -euo pipefail
OUT=${OUT:?set OUT to the results folder}
DEVICE=${DEVICE:-cuda}
ROWS=${ROWS:-1000000}
BATCH=${BATCH:-8192}
STEPS=${STEPS:-30}
PY=${PY:-python}
[ -x .venv/bin/python ] && PY=.venv/bin/python
mkdir -p "$OUT"
common=(--in-process --device "$DEVICE" --rows-per-field "$ROWS" --batch "$BATCH" --dim 16 --hidden 512,256)
run() {  # run NAME TIMEOUT ARGS...: one bench run, its JSON to $OUT/NAME.json (none if it failed)
  local name=$1 limit=$2
  shift 2
  rm -f bench/results/pctr_device-*.json
  if timeout "$limit" "$PY" bench/pctr_throughput.py "${common[@]}" "$@" >"$OUT/$name.log" 2>&1; then
    cp bench/results/pctr_device-*.json "$OUT/$name.json"
  else
    echo "$name did not finish (exit $?), see $OUT/$name.log"
  fi
  tail -n 4 "$OUT/$name.log"
}
# the eager step first: its numbers stand even if the compiled run below runs out of time
run pctr_device 60 --steps "$STEPS" --rounds 5
run pctr_device_compiled 85 --steps "$STEPS" --rounds 3 --compile
rm -f bench/results/pctr_device-*.json
