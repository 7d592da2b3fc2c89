#!/usr/bin/env bash
# The pCTR step compiled and replayed as a CUDA graph by default on a GPU (issue 32, task w5-compile): one
# device call of at most ~200 s on one H200, from the repository root with .gpu/ packed (as wave3c.sh):
#   MARIANA_COMMIT=<hash> bash scripts/gpu/wave3d.sh        (it sources .gpu/setup.sh itself)
# (a) the gpu-marked tests: tests/test_pctr_compile.py (the default CUDA step = compiled + CUDA graphs: the
#     eager step's model, no recompile, no host sync, no CUDA-graph skip), then after (b)
#     tests/test_host_reads.py (the ASR step, unchanged here: lower priority);
# (b) the pCTR device bench at the issue's sizes: `ours` (what `pctr train --device cuda` runs by default),
#     `ours_eager` (--compile off) and the plain loop, interleaved rounds -> $OUT/pctr_device.json;
# (c) if time is left, `mariana pctr train --device cuda` (the CLI path, default compile) on a generated
#     Criteo file -> $OUT/cli/ (metrics, log).
# Everything lands in $OUT (wave3d.log, steps.out, pctr_device.json, cli/). Each step is capped (timeout).
# CPU proof (tiny sizes; --compile on with aot_eager for the CLI run, the CPU default being eager):
#   DEVICE=cpu ROWS=1000 BATCH=64 STEPS=2 CLI_ROWS=3000 CLI_RPF=1000 CLI_EXTRA="--compile on --compile-backend aot_eager" \
#     OUT=/tmp/w3d bash scripts/gpu/wave3d.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$OUT/wave3d.log; T0=$(date +%s)
DEVICE=${DEVICE:-cuda}; ROWS=${ROWS:-1000000}; BATCH=${BATCH:-8192}; STEPS=${STEPS:-30}; BUDGET=${BUDGET:-200}
CLI_ROWS=${CLI_ROWS:-200000}; CLI_RPF=${CLI_RPF:-100000}; CLI_EXTRA=${CLI_EXTRA:-}
export PYTHONUNBUFFERED=1 MARIANA_COMMIT=${MARIANA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ -f .gpu/setup.sh ] && ! python3 -c "import mariana, pytest" 2>/dev/null; then source .gpu/setup.sh; fi
PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$L"; }
step() { local n=$1 t=$2; shift 2; say ">>> $n (cap ${t}s): $*"; timeout -k 5 "$t" "$@" > "$TMP/step.out" 2>&1
  local rc=$?; say "<<< $n rc=$rc"; { echo "=== $n"; cat "$TMP/step.out"; } >> "$OUT/steps.out"
  grep -v "^W1\|^I1\|Warning" "$TMP/step.out" | tail -n 14 | tee -a "$L"; return $rc; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
say "commit $MARIANA_COMMIT, device $DEVICE, $($PY -c 'import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")')"

# (a) the new gpu test first (-rP: it prints its CUDA-graph counters and the compiled-vs-eager differences)
step pytest_pctr_compile 50 $PY -m pytest -q -p no:cacheprovider -m gpu -rsP tests/test_pctr_compile.py

# (b) bench/results/pctr_device-{gpu,cpu}.json is the run's result; copied to $OUT
tag=$($PY -c 'import torch; print("gpu" if torch.cuda.is_available() else "cpu")')
step pctr_bench 95 $PY bench/pctr_throughput.py --in-process --device "$DEVICE" --rows-per-field "$ROWS" \
  --batch "$BATCH" --dim 16 --hidden 512,256 --steps "$STEPS" --rounds 5 \
  && cp "bench/results/pctr_device-$tag.json" "$OUT/pctr_device.json"

# (a') the host-read tests' gpu cases (the ASR step under torch.cuda.set_sync_debug_mode("error"))
cap=$(left); [ "$cap" -gt 45 ] && cap=45
[ "$cap" -ge 10 ] && step pytest_host_reads "$cap" $PY -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_host_reads.py

# (c) the CLI path, if at least 30 s are left
if [ "$(left)" -ge 30 ]; then
  mkdir -p "$OUT/cli"
  $PY -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from pctr_throughput import generate; \
generate(Path('$TMP/criteo.tsv'), $CLI_ROWS, $CLI_RPF, 1.2)" && say "generated $CLI_ROWS criteo lines"
  step pctr_cli $(( $(left) - 3 )) $PY -m mariana.platform.cli pctr train --data "$TMP/criteo.tsv" --format criteo \
    --model deepfm --rows-per-field "$CLI_RPF" --dim 16 --hidden 512,256 --batch-size "$BATCH" --split 0.9,0.1,0 \
    --max-steps 80 --log-every 20 --eval-every 0 --early-stop 0 --device "$DEVICE" --no-progress \
    --out "$TMP/run" $CLI_EXTRA
  cp "$TMP"/run/metrics.json "$TMP"/run/metrics.jsonl "$TMP"/run/*.log "$OUT/cli/" 2>/dev/null
  [ -f "$TMP/run/metrics.json" ] && $PY -c "import json; m = json.load(open('$TMP/run/metrics.json')); \
print({k: m.get(k) for k in ('steps', 'device', 'val_auc', 'val_logloss', 'wall_time_s', 'samples_per_s')}); \
r = [json.loads(x) for x in open('$TMP/run/metrics.jsonl') if 'step_time_s' in x]; \
print('log windows (step, samples/s, step_time_s):', [(x['step'], round(x['samples_per_s']), round(x['step_time_s'], 5)) for x in r])" | tee -a "$L"
else
  say "pctr_cli skipped: $(left) s left of $BUDGET"
fi
say "done in $(( $(date +%s) - T0 ))s"
