#!/usr/bin/env bash
# The merged tree's GPU check (wave 3, session 2), one device call of about 4 minutes on one H200, from the
# repository root with .gpu/ packed (bash ../shared/gpu/pack.sh; pytest's wheels added to .gpu/whl):
#   MARIANA_COMMIT=<hash> bash scripts/gpu/wave3c.sh        (it sources .gpu/setup.sh itself)
# 1. the gpu-marked tests: the ASR step (compiled, the GPU default, and eager) under
#    torch.cuda.set_sync_debug_mode("error");
# 2. issue 32's pCTR figure on the parameter-server framework as merged (platform/ps): our one-process step,
#    eager and compiled, vs the like-for-like plain loop (scripts/gpu/pctr.sh).
# Everything lands in $OUT (wave3c.log, steps.out, pctr_device*.json).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$OUT/wave3c.log; T0=$(date +%s)
export PYTHONUNBUFFERED=1 MARIANA_COMMIT=${MARIANA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ -f .gpu/setup.sh ] && ! python3 -c "import soundfile, mariana, pytest" 2>/dev/null; then source .gpu/setup.sh; fi
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$L"; }
step() { local n=$1 t=$2; shift 2; say ">>> $n (cap ${t}s): $*"; timeout -k 5 "$t" "$@" > /tmp/w3c-step.out 2>&1
  local rc=$?; say "<<< $n rc=$rc"; { echo "=== $n"; cat /tmp/w3c-step.out; } >> "$OUT/steps.out"
  grep -v "^W1\|^I1\|Warning" /tmp/w3c-step.out | tail -n 12 | tee -a "$L"; return $rc; }
say "commit $MARIANA_COMMIT, $(python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())')"
step pytest_gpu 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_host_reads.py
step pctr 150 env OUT="$OUT" PY=python3 bash scripts/gpu/pctr.sh
say "done in $(( $(date +%s) - T0 ))s"
