#!/usr/bin/env bash
# After the benchmarks were split by system (issue 12, bench/README.md):
# runs every usmipc_bench and bench_cuda.py invocation of tests/gpu/run.sh
# briefly on the GPU and checks that each JSON has the layout of the results
# kept from before the split (bench/results/, H200, 2026-11-29), with no
# errors: usmipc_bench on CUDA (fd, native), --raw (fd, native: they measure
# again since the raw path reads wire format v2), bench_cuda.py (every
# system, 4 KiB and 1 MiB). A few minutes; results and logs go to $OUT.
#
#   OUT=/tmp/out bash tests/gpu/bench_split_check.sh
#
# Needs what tests/gpu/run.sh needs (torch, cupy, cuda.core); builds into
# build-gpu and installs usmipc into python3 unless SKIP_BUILD=1.
set -u
OUT=${OUT:-/tmp/usmipc-bench-split}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
REF=bench/results
status=0
step() { # step NAME COMMAND...: runs, logs, records pass/fail
  local name=$1; shift
  echo "=== $name: $*"
  if "$@" > "$OUT/$name.log" 2>&1; then r=pass; else r="FAIL($?)"; status=1; fi
  tail -n 12 "$OUT/$name.log"
  echo "=== $name: $r"
  echo "$name $r" >> "$OUT/summary.txt"
}
: > "$OUT/summary.txt"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  step build bash -c 'cmake -S . -B build-gpu -DUSMIPC_WERROR=ON && cmake --build build-gpu -j 16'
  step pip python3 -m pip install --no-build-isolation --no-index --no-deps .
fi
B=build-gpu/bench/usmipc_bench
step c-cuda-fd env USMIPC_CUDA_IPC=fd $B --device cuda:gpu:0 --sizes 4096,1048576 --k 10 --rounds 1 --iters 200 --json "$OUT/bench_c_cuda_fd.json"
step c-cuda-native env USMIPC_CUDA_IPC=native $B --device cuda:gpu:0 --sizes 4096,1048576 --k 10 --rounds 1 --iters 200 --json "$OUT/bench_c_cuda_native.json"
step raw-fd $B --raw --device cuda:gpu:0 --kind fd --sizes 4096,1048576 --k 20 --rounds 1 --json "$OUT/bench_raw_fd.json"
step raw-native $B --raw --device cuda:gpu:0 --kind native --sizes 4096,1048576 --k 20 --rounds 1 --json "$OUT/bench_raw_native.json"
step bench-cuda python3 bench/bench_cuda.py --sizes 4K,1M --k 5 --repeat-export 100 --reopen 100 --torch-repeat 20 --bw-reps 5 --json "$OUT/bench_cuda.json" --plot "$OUT/bench_cuda.png"
step selftest python3 bench/bench_cuda.py --selftest

L="python3 tests/gpu/bench_layout.py"
step layout-c-fd $L $REF/h200-x2-2026-11-29/bench_c_cuda_fd.json "$OUT/bench_c_cuda_fd.json" --no-errors
step layout-c-native $L $REF/h200-x2-2026-11-29/bench_c_cuda_native.json "$OUT/bench_c_cuda_native.json" --no-errors
step layout-raw-fd $L $REF/h200-2026-11-29-run4/bench_raw_fd.json "$OUT/bench_raw_fd.json" --no-errors
step layout-raw-native $L $REF/h200-2026-11-29-run4/bench_raw_fd.json "$OUT/bench_raw_native.json" --no-errors
step layout-cuda $L $REF/h200-x2-2026-11-29/bench_cuda.json "$OUT/bench_cuda.json" --no-errors
echo "=== summary"; cat "$OUT/summary.txt"
exit $status
