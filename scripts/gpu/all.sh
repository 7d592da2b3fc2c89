#!/usr/bin/env bash
# Every GPU check of wave 3 in one device call (about 9 minutes at most on one H200), from the repository root
# of a copy carrying .gpu/ (bash ../shared/gpu/pack.sh):
#   source .gpu/setup.sh && bash scripts/gpu/all.sh
# Order: pCTR (issue 32), vision (issue 34), ASR/device speed (issue 33); each part has its own time cap so a
# slow part cannot take the others' time. Results land under $OUT/{pctr,vision,speed}/.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; T0=$(date +%s)
export PY=python3 PYTHON=python3 PYTHONUNBUFFERED=1
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/all.log"; }
part() { local n=$1 t=$2; shift 2; mkdir -p "$OUT/$n"; say ">>> $n (cap ${t}s)"
  OUT=$OUT/$n timeout -k 5 "$t" "$@" > "$OUT/$n/driver.out" 2>&1; say "<<< $n rc=$?"; tail -n 25 "$OUT/$n/driver.out"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/all.log"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/all.log"
part pctr "${PCTR_CAP:-140}" bash scripts/gpu/pctr.sh
SEEDS=${SEEDS:-3} part vision "${VISION_CAP:-215}" bash scripts/gpu/vision.sh
part speed "${SPEED_CAP:-200}" bash scripts/gpu/speed.sh
say "all done"
