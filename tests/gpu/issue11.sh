#!/usr/bin/env bash
# The GPU run of issue 11 (pools, bundles, expandable segments, the PyTorch
# allocator): the whole C suite on cuda:gpu:0 with both allocation kinds,
# every GPU Python test, the pool block bench and the weight handoff. Every
# step runs even if one fails; logs to $OUT (issue11.log, summary.txt, JSON).
#   OUT=/tmp/out bash tests/gpu/issue11.sh [REPS]
set -u
OUT=${OUT:-/tmp/usmipc-gpu}; mkdir -p "$OUT"
REPS=${1:-5}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
LOG="$OUT/issue11.log"; : > "$LOG"; : > "$OUT/summary.txt"
step() {
  local name=$1; shift
  local t0=$(date +%s)
  { echo "=== $name: $*"; } >> "$LOG"
  if "$@" >> "$LOG" 2>&1; then r=pass; else r="FAIL($?)"; fi
  echo "$name $r $(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt" >> "$LOG"
}
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'; } >> "$LOG" 2>&1
step build bash -c 'cmake -S . -B build-gpu -DUSMIPC_WERROR=ON >/dev/null && cmake --build build-gpu -j 16 2>&1 | grep -E "error|warning|Built target usmipc_tests"'
step c-cuda-fd env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=fd timeout 280 build-gpu/tests/c/usmipc_tests
step c-cuda-native env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=native timeout 280 build-gpu/tests/c/usmipc_tests
step pip python3 -m pip install -q --no-build-isolation --no-index --no-deps .
step pytest-gpu timeout 400 python3 -m pytest -q -rs -s tests/gpu --ignore=tests/gpu/test_events.py
step bench-pool build-gpu/bench/usmipc_bench_pool --device cuda:gpu:0 --json "$OUT/bench_pool_h200.json"
step bench-weights timeout 300 python3 bench/bench_weights.py --reps "$REPS" --json "$OUT/bench_weights_h200.json"
echo "=== summary" >> "$LOG"; cat "$OUT/summary.txt"
