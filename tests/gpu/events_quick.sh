#!/usr/bin/env bash
# The events part of tests/gpu/run.sh, for a short lease: builds, runs the C
# event tests on the CUDA device (both allocation kinds), the event costs
# (usmipc_bench_event) and the handoff latency (bench/bench_events.py).
#   OUT=/tmp/out bash tests/gpu/events_quick.sh
set -u
OUT=${OUT:-/tmp/usmipc-gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
cmake -S . -B build-gpu -DUSMIPC_WERROR=ON > /dev/null && cmake --build build-gpu -j 16 > /dev/null || echo BUILD FAILED
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo PIP FAILED
for t in $(grep -o 'X(event_[a-z_]*)' tests/c/test_list.h | sed 's/X(\(.*\))/\1/'); do
  for k in fd native; do
    USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=$k timeout 120 build-gpu/tests/c/usmipc_tests $t > /tmp/t.log 2>&1
    rc=$?; echo "$t $k rc=$rc"; [ $rc = 0 ] || [ $rc = 77 ] || tail -5 /tmp/t.log
  done
done
env USMIPC_CUDA_IPC=native build-gpu/bench/usmipc_bench_event --device cuda:gpu:0 --k 400 --json "$OUT/bench_event_h200.json"
build-gpu/bench/usmipc_bench_event --device host:cpu --json "$OUT/bench_event_host_h200.json"
timeout 400 python3 bench/bench_events.py --trials 100 --json "$OUT/bench_handoff_h200.json" 2>&1 | grep -v Deprecation | tail -25
