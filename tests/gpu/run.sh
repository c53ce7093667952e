#!/usr/bin/env bash
# The GPU verification run, for the device machine (NVIDIA H200): builds
# usmipc, runs the C suite on the CUDA device for both allocation kinds, the
# Python suites (host and tests/gpu), the demo, and the benchmarks. Every
# step runs even if an earlier one failed; logs and results go to $OUT.
#
#   OUT=/tmp/out bash tests/gpu/run.sh [quick]
#
# "quick" skips the long benchmarks (bench_weights.py runs with 3
# repetitions instead of 10). Needs python3 with scikit-build-core, pytest,
# numpy, torch, cupy and cuda.core (the device image has them) and no network.
set -u
OUT=${OUT:-/tmp/usmipc-gpu}
mkdir -p "$OUT"
LOGS=$(mktemp -d)   # per-step logs; $OUT gets one combined gpu.log (8 files come back)
# Never use NVLink multicast on the shared machines (device README).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
mode=${1:-full}
status=0
step() { # step NAME COMMAND...: runs, logs, records pass/fail
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$(date +%s)
  if "$@" > "$LOGS/$name.log" 2>&1; then r=pass; else r="FAIL($?)"; status=1; fi
  { echo "=== $name: $*"; cat "$LOGS/$name.log"; echo "=== $name: $r"; } >> "$OUT/gpu.log"
  tail -n 15 "$LOGS/$name.log"
  echo "=== $name: $r in $(( $(date +%s) - t0 ))s"
  echo "$name $r $(( $(date +%s) - t0 ))s" >> "$OUT/summary.txt"
}

{
  date -u
  nvidia-smi --query-gpu=index,name,driver_version,uuid --format=csv
  nvidia-smi topo -m 2>/dev/null | head -5
  uname -r
  python3 -c 'import sys, torch, cupy; print(sys.version); print("torch", torch.__version__, "cupy", cupy.__version__)'
} > "$OUT/gpu.log" 2>&1
cat "$OUT/gpu.log"
: > "$OUT/summary.txt"

step build bash -c 'cmake -S . -B build-gpu -DUSMIPC_WERROR=ON && cmake --build build-gpu -j 16'
step ctest-host ctest --test-dir build-gpu -j 8 --output-on-failure
step c-cuda-fd env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=fd build-gpu/tests/c/usmipc_tests
step c-cuda-native env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=native build-gpu/tests/c/usmipc_tests
step pip python3 -m pip install --no-build-isolation --no-index --no-deps .
step py-list python3 -m usmipc
step demo-cuda python3 -m usmipc demo --device cuda:gpu
step demo-host python3 -m usmipc demo --device host:cpu
step pytest-host python3 -m pytest -q -rs tests/python
step pytest-gpu python3 -m pytest -q -rs -s tests/gpu --ignore=tests/gpu/test_torch_allocator.py
# Every code block of README.md and docs/, the GPU ones included.
step doc-blocks bash tests/gpu/doc_blocks.sh
# usmipc pools as torch's CUDA allocator: each case in a fresh process
# (torch's allocator is chosen once per process); prints one RESULT line per
# case (segments, driver exports and imports per sharing round).
step torch-allocator python3 -m pytest -v -rs -s tests/gpu/test_torch_allocator.py
# The transport's first-open and broker-concurrency benches (host memory, all
# cores of the device machine): cheap, so they run in quick mode too.
step bench-first build-gpu/bench/usmipc_bench_first --k 60 --json "$OUT/bench_first_h200.json"
step bench-broker build-gpu/bench/usmipc_bench_broker --json "$OUT/bench_broker_h200.json"
# Events (issue 10): their C costs against the bare driver, and the handoff
# latency against torch.multiprocessing and a CuPy host synchronize.
step bench-event env USMIPC_CUDA_IPC=native build-gpu/bench/usmipc_bench_event --device cuda:gpu:0 --k 400 --json "$OUT/bench_event_h200.json"
step bench-event-host build-gpu/bench/usmipc_bench_event --device host:cpu
step bench-handoff python3 bench/bench_events.py --trials 100 --json "$OUT/bench_handoff_h200.json"
# Weight handoff (issue 11): a Qwen2.5-1.5B bf16 state dict (338 tensors,
# 3.1 GB) through usmipc bundles against torch.multiprocessing, a flattened
# bucket and cuda.core. Quick mode: the full shapes, 3 repetitions (~40 s).
if [ "$mode" = quick ]; then
  step bench-weights-quick timeout 240 python3 bench/bench_weights.py --reps 3 --json "$OUT/bench_weights_quick_h200.json"
fi

if [ "$mode" != quick ]; then
  step bench-c-cuda-fd env USMIPC_CUDA_IPC=fd build-gpu/bench/usmipc_bench --device cuda:gpu:0 --sizes 4096,1048576,268435456,1073741824 --json "$OUT/bench_c_cuda_fd.json"
  step bench-c-cuda-native env USMIPC_CUDA_IPC=native build-gpu/bench/usmipc_bench --device cuda:gpu:0 --sizes 4096,1048576,268435456,1073741824 --json "$OUT/bench_c_cuda_native.json"
  step bench-raw-fd build-gpu/bench/usmipc_bench --raw --device cuda:gpu:0 --kind fd --k 60 --rounds 2 --json "$OUT/bench_raw_fd.json"
  step bench-raw-native build-gpu/bench/usmipc_bench --raw --device cuda:gpu:0 --kind native --k 60 --rounds 2 --json "$OUT/bench_raw_native.json"
  step bench-cuda python3 bench/bench_cuda.py --json "$OUT/bench_cuda.json" --plot "$OUT/bench_cuda.png"
  step bench-weights timeout 540 python3 bench/bench_weights.py --reps 10 --json "$OUT/bench_weights_h200.json"
fi
echo "=== summary"; cat "$OUT/summary.txt"
exit $status
