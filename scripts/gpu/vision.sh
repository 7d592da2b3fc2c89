#!/usr/bin/env bash
# Issue 34's GPU step (budget: 240 s wall on one H200, compile included): our `fast` preset against the
# airbench paper's train94 on the same tars (bench/vision_airbench.py, N seeds interleaved, 10 epochs, the
# training seconds of both exclude compile/warm-up), then the JPEG-to-device rate of the decode-once path
# against the on-device synthetic rate (bench/vision_throughput.py --cached-epochs 10).
# Run from the repository root on the GPU machine; results (JSON + logs) land in $OUT.
#   source .gpu/setup.sh && bash scripts/gpu/vision.sh
# Env: OUT (default /tmp/out), DATA (default ../shared/data/cifar10), SEEDS (default 5), DEVICE (cuda;
# cpu with tiny sizes to try the script), BENCH_ARGS / TP_ARGS (extra flags for the two benches).
set -u
T0=$(date +%s); OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$OUT/vision.log
DATA=${DATA:-../shared/data/cifar10}; SEEDS=${SEEDS:-5}; DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}; export PYTHONUNBUFFERED=1
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$L"; }
if [ -f .gpu/setup.sh ] && ! $PY -c "import mariana.apps.vision" 2>/dev/null; then source .gpu/setup.sh; fi
# airbench: a bench-only extra; the coordinator drops its wheel (or sdist) into .gpu/extra/
if ! $PY -c "import airbench" 2>/dev/null; then
  pkg=$(ls .gpu/extra/airbench-*.whl .gpu/extra/airbench-*.tar.gz 2>/dev/null | head -n 1)
  if [ -n "$pkg" ]; then
    $PY -m pip install -q --no-deps --no-index --no-build-isolation "$pkg" 2>>"$L" || {
      $PY -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/site-airbench "$pkg"
      export PYTHONPATH=/tmp/site-airbench${PYTHONPATH:+:$PYTHONPATH}; }
  fi
fi
say "airbench: $($PY -c 'import airbench, importlib.metadata as m; print(m.version("airbench"))' 2>&1 | tail -n 1)"
say ">>> vision_airbench (seeds $SEEDS, $DEVICE)"
timeout -k 5 175 $PY bench/vision_airbench.py --device "$DEVICE" --seeds "$SEEDS" \
  --data "$DATA/train.tar" --eval-data "$DATA/test-dev.tar" --json "$OUT/vision_airbench-gpu.json" ${BENCH_ARGS:-} \
  > "$OUT/vision_airbench.out" 2>&1
say "<<< vision_airbench rc=$?"; grep -v " INFO " "$OUT/vision_airbench.out" | tail -n 12 | tee -a "$L"
say ">>> vision_throughput decode-once (fastnet@32, 10 epochs)"
# headline: decode in 8 CPU worker processes; also timed: nvJPEG in-process (0) and 16 workers (decode only)
timeout -k 5 55 $PY bench/vision_throughput.py --device "$DEVICE" --models fastnet@32 --cached-epochs 10 \
  --steps 30 --batch 1024 --data "$DATA/train.tar" --out "$OUT/vision_throughput-jpeg.json" \
  --decode-workers "${DECODE_WORKERS:-8,0,16}" ${TP_ARGS:-} \
  > "$OUT/vision_throughput.out" 2>&1
say "<<< vision_throughput rc=$?"; tail -n 2 "$OUT/vision_throughput.out" | tee -a "$L"
say "done"
