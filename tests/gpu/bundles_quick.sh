#!/usr/bin/env bash
# A short GPU check of pools and bundles (issue 11): the C tests of pools,
# bundles and counters on cuda:gpu:0 with both allocation kinds, the Python
# GPU bundle tests and the weight-handoff bench with few repetitions. Logs
# to $OUT/bundles.log.   OUT=/tmp/out bash tests/gpu/bundles_quick.sh
set -u
OUT=${OUT:-/tmp/usmipc-gpu}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/bundles.log") 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
cmake -S . -B build-gpu -DUSMIPC_WERROR=ON >/dev/null && cmake --build build-gpu -j 16 2>&1 | grep -E "error|warning" ; echo "build done"
for kind in fd native; do
  for t in pool_basics pool_threads pool_hundred_thousand_blocks stats_count_driver_work bundle_cross_process bundle_refused bundle_ten_thousand_arrays bundle_release_cross_process bundle_release_consumer_dies bundle_release_same_process ipc_no_leak_uncached; do
    USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=$kind timeout 120 build-gpu/tests/c/usmipc_tests $t > /tmp/t.log 2>&1
    echo "c $kind $t rc=$?"; grep -E "FAIL|opened and checked" /tmp/t.log | head -5
  done
done
python3 -m pip install -q --no-build-isolation --no-index --no-deps . 2>&1 | tail -2
timeout 300 python3 -m pytest -q -rs -x tests/gpu/test_gpu_bundles.py 2>&1 | tail -25
timeout 240 python3 bench/bench_weights.py --reps 3 --json "$OUT/bench_weights_quick.json" 2>&1 | tail -40
echo "=== done"
