#!/usr/bin/env bash
# Issue 33's closing GPU checks in one device call (about 6 minutes on one H200), from the repository root
# of a copy carrying .gpu/ (bash ../shared/gpu/pack.sh):
#   MARIANA_COMMIT=<hash> bash scripts/gpu/wave3b.sh        (it sources .gpu/setup.sh itself)
# The device tool copies the session's own checkout, not a helper's worktree: issue 33's run put
# `git archive --format=tar.gz -o CHECKOUT/.gpu/w4gpu/src.tar.gz COMMIT` (and pytest's wheels) into the
# checkout's ignored .gpu/, unpacked it on the machine into /tmp/w4/repo with .gpu/ beside the code, and ran
# this script there. Each step has its own time cap; results land in $OUT (the JSONs below, every step's output in steps.out, the
# step log in wave3b.log):
#   asr_small.json          the default recipe's network (`small`), ours as training runs it on a GPU
#                           (compiled by default) vs the plain eager loop, and our path uncompiled as a
#                           third side of the same interleaved rounds (target >= 0.9x); + the sync check
#   asr_mariana.json        the 50.7M `mariana` DNN, bf16, ~8,192 frames/step, same three sides (>= 0.9x)
#   vision_steady.json      the gpu94 preset's path (CachedLoader + ModuleStep, compiled) vs the plain loop,
#                           same batch/precision/optimizer, steady-state images/s, interleaved rounds
#   (steps.out: pytest_gpu) the gpu-marked tests (torch.cuda.set_sync_debug_mode("error") on the ASR step)
#   asr_small_both_compiled.json   like for like with the plain loop compiled too (last: if time is left)
# CPU trial with tiny sizes: DEV=cpu STEPS=2 ROUNDS=2 MSTEPS=1 FRAMES=512 VSTEPS=1 VLIMIT=64 VBATCH=16 \
#   VPRESET=small OUT=/tmp/w3b bash scripts/gpu/wave3b.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$OUT/wave3b.log; T0=$(date +%s)
DEV=${DEV:-cuda}; STEPS=${STEPS:-40}; MSTEPS=${MSTEPS:-20}; ROUNDS=${ROUNDS:-7}; FRAMES=${FRAMES:-8192}
VSTEPS=${VSTEPS:-30}; VLIMIT=${VLIMIT:-10000}; VBATCH=${VBATCH:-0}; VPRESET=${VPRESET:-gpu94}
PY=${PY:-python3}
[ "$DEV" = cpu ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1 MARIANA_COMMIT=${MARIANA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ -f .gpu/setup.sh ] && ! $PY -c "import soundfile, mariana" 2>/dev/null; then source .gpu/setup.sh; fi
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$L"; }
# every step's output goes to one file, $OUT/steps.out: the device tool brings back only a few files
step() { local n=$1 t=$2; shift 2; say ">>> $n (cap ${t}s): $*"; timeout -k 5 "$t" "$@" > /tmp/w3b-step.out 2>&1
  local rc=$?; say "<<< $n rc=$rc"; { echo "=== $n"; cat /tmp/w3b-step.out; } >> "$OUT/steps.out"
  grep -v "^W1\|^I1\|Warning" /tmp/w3b-step.out | tail -n 8 | tee -a "$L"; return $rc; }
say "commit $MARIANA_COMMIT, $($PY -c 'import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")')"
D=${SPEED_DATA:-/tmp/speed-asr-data}
[ -f "$D/train/wav.scp" ] || step prepare 60 $PY -m mariana.platform.cli asr prepare \
  --data ../shared/data/fsdd/recordings --out "$D" --test-speakers yweweler --utterances 40 --max-digits 5
export MARIANA_COMPILE_CACHE=${MARIANA_COMPILE_CACHE:-/tmp/w3b-compile-cache}
A=(bench/asr_throughput.py --data "$D" --device "$DEV" --rounds "$ROUNDS" --also-eager)
step asr_small 100 $PY "${A[@]}" --steps "$STEPS" --name /tmp/asr_small --json "$OUT/asr_small.json" ||
  step asr_small_eager 60 $PY "${A[@]}" --steps "$STEPS" --compile off --name /tmp/asr_small_eager \
    --json "$OUT/asr_small_eager.json"
step asr_mariana 100 $PY "${A[@]}" --preset mariana --steps "$MSTEPS" --frames-per-step "$FRAMES" \
  --name /tmp/asr_mariana --json "$OUT/asr_mariana.json"
VB=(); [ "$VBATCH" != 0 ] && VB=(--batch "$VBATCH")
step vision_steady 120 $PY bench/vision_throughput.py --device "$DEV" --models none --steady "$VPRESET" \
  --steps "$VSTEPS" --steady-limit "$VLIMIT" "${VB[@]}" --out "$OUT/vision_steady.json"
if [ "$DEV" = cuda ]; then
  step pytest_gpu 120 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_host_reads.py
fi
left=$(( ${BUDGET:-370} - ($(date +%s) - T0) ))
if [ "$left" -gt 45 ]; then
  step asr_small_both_compiled "$left" $PY "${A[@]}" --steps "$STEPS" --plain-compile \
    --name /tmp/asr_small_both --json "$OUT/asr_small_both_compiled.json"
else
  say "skipped asr_small_both_compiled (${left}s left)"
fi
say "done in $(( $(date +%s) - T0 ))s"
