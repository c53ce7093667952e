#!/usr/bin/env bash
# The GPU runs of issue 12 (dpctl fidelity, packaging, docs) and issue 13
# (usmipc.distributed), in two halves that each fit one device call:
#
#   OUT=/tmp/out bash tests/gpu/issue12.sh a   build, the C suite on CUDA (fd,
#       native), the demo, tests/python on the GPU's default device, the
#       device-info checks, the GPU code blocks of the docs, and the GPU tests
#       left unverified by issue 11 (expandable bundles, torch allocator)
#   OUT=/tmp/out bash tests/gpu/issue12.sh b   the release wheel (dist/,
#       carried) under python3.12, the bench split check, and the
#       distributed tests on one GPU
#   OUT=/tmp/out bash tests/gpu/issue12.sh c   a crash of ipc_no_leak_uncached
#       (native), symbolised; the distributed and wheel runs again
#   OUT=/tmp/out bash tests/gpu/issue12.sh d   concurrent first opens of one
#       native handle (before and after the fix), the C suite, the wheel
#   OUT=/tmp/out bash tests/gpu/issue12.sh e   Exchange.barrier on one GPU,
#       the wheel
#
# Every step runs even if one fails; logs to $OUT/issue12-<half>.log and a
# summary line per step in $OUT/summary-issue12-<half>.txt (tests/gpu/steps.sh).
half=${1:-a}
. "$(dirname "$0")/steps.sh" "issue12-$half"

if [ "$half" = a ]; then
  step build 240 build
  step pip 120 install
  step c-cuda-fd 200 env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=fd build-gpu/tests/c/usmipc_tests
  step c-cuda-native 200 env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=native build-gpu/tests/c/usmipc_tests
  step demo-cuda 60 python3 -m usmipc demo --device cuda:gpu
  step demo-cuda-native 60 env USMIPC_CUDA_IPC=native python3 -m usmipc demo --device cuda:gpu
  step py-info 30 python3 -c 'import usmipc; d = usmipc.Device("cuda:gpu"); d.print_device_info(); print(d.driver_version, d.global_mem_size, d.max_mem_alloc_size)'
  step pytest-host 240 python3 -m pytest -q -rs tests/python
  step device-info 120 python3 -m pytest -q -rs tests/gpu/test_device_info_cuda.py
  step doc-blocks 200 env USMIPC_BUILD_DIR=build-gpu USMIPC_DOC_GPU=1 python3 -m pytest -q -rs tests/python/test_doc_blocks.py
  step expandable 120 python3 -m pytest -q -rs tests/gpu/test_bundles_expandable.py
  step torch-allocator 200 python3 -m pytest -q -rs tests/gpu/test_torch_allocator.py
elif [ "$half" = b ]; then
  step build 240 build
  step pip 120 install
  step c-cuda-native 200 env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=native build-gpu/tests/c/usmipc_tests
  step no-leak-uncached-x10 120 bash -c 'for i in $(seq 10); do USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=native build-gpu/tests/c/usmipc_tests ipc_no_leak_uncached || exit 1; done'
  step distributed 200 env OUT="$OUT/distributed" SKIP_BUILD=1 bash tests/gpu/distributed.sh one-gpu
  step wheel 150 env OUT="$OUT" WHEEL_SKIP_GPU=1 bash tests/gpu/wheel.sh
  step c-cuda-fd 200 env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=fd build-gpu/tests/c/usmipc_tests
  step bench-split 200 env OUT="$OUT/bench-split" SKIP_BUILD=1 bash tests/gpu/bench_split_check.sh
fi
# Half c: a crash of ipc_no_leak_uncached on native handles (seen in
# halves a and b), run alone with the runner's backtrace symbolised, and
# the halves of b that failed on the machine's set-up.
if [ "$half" = c ]; then
  step build 240 build
  step pip 120 install
  crash() {
    for i in 1 2 3 4 5; do
      USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=native \
        build-gpu/tests/c/usmipc_tests ipc_no_leak_uncached > /tmp/crash.txt 2>&1
      rc=$?; echo "run $i: exit $rc"; tail -5 /tmp/crash.txt
      if [ $rc -ne 0 ]; then
        # binary(+0xOFF) or binary(sym+0xOFF) frames: addr2line on the file.
        grep -oE '^[^ ()]+\([^)]*\)' /tmp/crash.txt | while IFS='(' read -r file rest; do
          off=${rest%)}; off=${off##*+}
          [ -f "$file" ] && printf '%s %s: ' "$file" "$off" && addr2line -f -i -p -C -e "$file" "$off" 2>/dev/null | head -2
        done
        if command -v gdb > /dev/null; then
          USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=native timeout 60 gdb -q -batch \
            -ex run -ex 'thread apply all bt 12' --args build-gpu/tests/c/usmipc_tests ipc_no_leak_uncached 2>&1 | tail -80
        fi
        return 1
      fi
    done
  }
  step crash 200 crash
  step distributed 200 env OUT="$OUT/distributed" SKIP_BUILD=1 bash tests/gpu/distributed.sh one-gpu
  step wheel 150 env OUT="$OUT/wheel" WHEEL_SKIP_GPU=1 bash tests/gpu/wheel.sh
  (cd "$OUT" && tar czf logs-c.tgz distributed wheel 2>/dev/null && rm -rf distributed wheel)
fi
# Half d: concurrent first opens of one native handle (the test first, on
# the commit before the fix when git is at hand), the crash hunt, the C
# suite again, and the wheel.
if [ "$half" = d ]; then
  before() {
    local c
    c=$(git log --format=%h -1 --grep='^Test ipc_open_same_handle_threads' 2>/dev/null)
    [ -n "$c" ] || { echo "no git history here"; return 0; }
    rm -rf /tmp/usmipc-before && git worktree add -f /tmp/usmipc-before "$c" > /dev/null 2>&1 || return 1
    cmake -S /tmp/usmipc-before -B /tmp/usmipc-before/build > /dev/null && cmake --build /tmp/usmipc-before/build -j 16 > /dev/null || return 1
    git log --oneline -1 "$c"
    # Expected to fail: the fix is the next commit.
    USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=native /tmp/usmipc-before/build/tests/c/usmipc_tests ipc_open_same_handle_threads
    echo "before the fix: exit $?"
  }
  step before 200 before
  step build 240 build
  step pip 120 install
  step same-handle 120 bash -c 'for k in native native native fd; do USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=$k build-gpu/tests/c/usmipc_tests ipc_open_same_handle_threads || exit 1; echo "$k ok"; done'
  step no-leak-uncached-x10 120 bash -c 'for i in $(seq 10); do USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=native build-gpu/tests/c/usmipc_tests ipc_no_leak_uncached 2>&1 | tail -3 || exit 1; done'
  step c-cuda-native 200 env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=native build-gpu/tests/c/usmipc_tests
  step c-cuda-fd 200 env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=fd build-gpu/tests/c/usmipc_tests
  step demo-cuda-native 60 env USMIPC_CUDA_IPC=native python3 -m usmipc demo --device cuda:gpu
  step wheel 150 env OUT="$OUT/wheel" WHEEL_SKIP_GPU=1 bash tests/gpu/wheel.sh
  (cd "$OUT" && tar czf logs-d.tgz wheel 2>/dev/null && rm -rf wheel)
fi
# Half e: the device-side barrier of usmipc.distributed on one GPU, and
# the wheel again.
if [ "$half" = e ]; then
  step build 240 build
  step pip 120 install
  step distributed 200 env OUT="$OUT/distributed" SKIP_BUILD=1 bash tests/gpu/distributed.sh one-gpu
  step wheel 200 env OUT="$OUT/wheel" WHEEL_SKIP_GPU=1 bash tests/gpu/wheel.sh
  (cd "$OUT" && tar czf logs-e.tgz distributed wheel 2>/dev/null && rm -rf distributed wheel)
fi
# Half f: tests/gpu/test_cuda.py whole (a legacy handle another library
# opened first in the importer among them), concurrent first opens.
if [ "$half" = f ]; then
  step build 240 build
  step pip 120 install
  step test-cuda 300 python3 -m pytest -q -rs tests/gpu/test_cuda.py
  step same-handle 120 bash -c 'for k in native native fd; do USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=$k build-gpu/tests/c/usmipc_tests ipc_open_same_handle_threads || exit 1; echo "$k ok"; done'
fi
summary
