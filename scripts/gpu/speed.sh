#!/usr/bin/env bash
# Issue 33's GPU checks, from the repository root (after `source .gpu/setup.sh` where soundfile is missing;
# this script sources it itself when it finds it). Expected about 2 minutes on one H200 (timeouts: 5 min). Writes under $OUT:
#   asr_throughput.json          default recipe (`small` network) vs its plain loop, 5 interleaved rounds
#                                (target >= 0.9x), and the sync check (set_sync_debug_mode("error"))
#   asr_throughput_mariana.json  the 50.7M `mariana` DNN, bf16, ~8,192 frames/step vs its plain loop (>= 0.9x)
#   asr_compile_start.json       two fresh --compile starts, the second from the first's saved artifacts
#   sync_test.out                the gpu-marked pytest (set_sync_debug_mode("error")) where pytest exists
#   speed.log                    every step's command, exit code and wall time
# Sizes: DEV=cpu STEPS=2 ROUNDS=2 MSTEPS=1 FRAMES=512 NO_COMPILE_START=1 for a trial run on a CPU.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$OUT/speed.log; T0=$(date +%s)
DEV=${DEV:-cuda}; STEPS=${STEPS:-40}; MSTEPS=${MSTEPS:-30}; ROUNDS=${ROUNDS:-5}; FRAMES=${FRAMES:-8192}
PY=${PY:-python3}
if ! $PY -c "import soundfile" 2>/dev/null && [ -f .gpu/setup.sh ]; then source .gpu/setup.sh; fi
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$L"; }
step() { local n=$1 t=$2; shift 2; say ">>> $n: $*"; timeout -k 5 "$t" "$@" > "$OUT/$n.out" 2>&1
  say "<<< $n rc=$?"; tail -n 4 "$OUT/$n.out" | tee -a "$L"; }
D=${SPEED_DATA:-/tmp/speed-asr-data}
[ -f "$D/train/wav.scp" ] || step prepare 60 $PY -m mariana.platform.cli asr prepare \
  --data ../shared/data/fsdd/recordings --out "$D" --test-speakers yweweler --utterances 40 --max-digits 5
export MARIANA_COMPILE_CACHE=${MARIANA_COMPILE_CACHE:-/tmp/speed-compile-cache}
step asrbench 60 $PY bench/asr_throughput.py --data "$D" --device "$DEV" --steps "$STEPS" --rounds "$ROUNDS" \
  --name asr_throughput_speed --json "$OUT/asr_throughput.json"
step mariana 60 $PY bench/asr_throughput.py --data "$D" --device "$DEV" --preset mariana --steps "$MSTEPS" \
  --rounds "$ROUNDS" --frames-per-step "$FRAMES" --name asr_throughput_mariana --json "$OUT/asr_throughput_mariana.json"
if [ "$DEV" = cuda ] && $PY -c "import pytest" 2>/dev/null; then
  step sync_test 60 $PY -m pytest -q -p no:cacheprovider tests/test_host_reads.py -k cuda_sync_debug
fi
[ -n "${NO_COMPILE_START:-}" ] || step compile_start 120 $PY bench/asr_throughput.py --data "$D" --device "$DEV" \
  --steps 1 --rounds 1 --compile-start --name asr_compile_start --json "$OUT/asr_compile_start.json"
say "done in $(( $(date +%s) - T0 ))s"
