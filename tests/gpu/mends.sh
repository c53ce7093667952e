#!/usr/bin/env bash
# The GPU runs of the mends after issue 13 (release tickets for bundles, the
# extension's shared helpers, the CUDA declarations' header, the driver
# probe behind the legacy-handle lock), in halves that each fit one device
# call:
#
#   OUT=/tmp/out bash tests/gpu/mends.sh a   build, the driver probe
#       (unlocked and locked, one handle and a handle per thread), the C
#       suite on CUDA (fd, native), the threaded legacy-handle tests again
#       (5 and 10 runs), the --raw benchmark peer
#   OUT=/tmp/out bash tests/gpu/mends.sh probe   build and the probe alone
#   OUT=/tmp/out bash tests/gpu/mends.sh b   build, tests/gpu/test_bundles.py,
#       test_events.py, test_cuda.py, the GPU code blocks of the docs,
#       tests/python on the GPU machine, the demo
#
# Every step runs even if one fails; logs to $OUT/mends-<half>.log and a
# summary line per step in $OUT/summary-mends-<half>.txt (tests/gpu/steps.sh).
half=${1:-a}
. "$(dirname "$0")/steps.sh" "mends-$half"

# The driver, threads opening and closing legacy handles at once: each run
# in a process of its own, so that a crash (exit 139) is counted, not fatal.
probe() {
  local p=build-gpu/tests/c/probe_native_open_close crashes=0
  for mode in unlocked unlocked unlocked unlocked unlocked unlocked locked locked; do
    "$p" $mode 8 2000; rc=$?
    echo "exit $rc ($mode)"; [ $rc -ge 128 ] && crashes=$((crashes + 1))
  done
  for mode in unlocked locked unlocked locked; do
    "$p" $mode 8 500 distinct; echo "exit $? ($mode, distinct)"
  done
  "$p" unlocked 1 4000 distinct; echo "exit $? (one thread)"
  echo "crashes: $crashes"
}

if [ "$half" = probe ]; then
  step build 240 build
  step probe 240 probe
fi
if [ "$half" = a ]; then
  step build 240 build
  step probe 240 probe
  step c-cuda-fd 200 env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=fd build-gpu/tests/c/usmipc_tests
  step c-cuda-native 200 env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=native build-gpu/tests/c/usmipc_tests
  # The striped legacy-handle locks: the tests of threads opening at once.
  step same-handle-x5 120 bash -c 'for i in 1 2 3 4 5; do USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=native build-gpu/tests/c/usmipc_tests ipc_open_same_handle_threads > /dev/null || exit 1; done; echo 5 passed'
  step no-leak-uncached-x10 200 bash -c 'for i in $(seq 10); do USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=native build-gpu/tests/c/usmipc_tests ipc_no_leak_uncached 2>&1 | tail -2; [ ${PIPESTATUS[0]} -eq 0 ] || exit 1; done'
  step raw-native 60 build-gpu/bench/usmipc_bench --raw --device cuda:gpu:0 --kind native --sizes 4096,1048576 --k 10 --rounds 1
  step raw-fd 60 build-gpu/bench/usmipc_bench --raw --device cuda:gpu:0 --kind fd --sizes 4096,1048576 --k 10 --rounds 1
fi
if [ "$half" = b ]; then
  step build 240 build
  step pip 120 install
  step bundles 200 python3 -m pytest -q -rs tests/gpu/test_bundles.py
  step events 200 python3 -m pytest -q -rs tests/gpu/test_events.py
  step test-cuda 300 python3 -m pytest -q -rs tests/gpu/test_cuda.py
  step doc-blocks-gpu 200 env USMIPC_BUILD_DIR=build-gpu USMIPC_DOC_GPU=1 python3 -m pytest -q -rs tests/python/test_doc_blocks.py
  step pytest-host 240 python3 -m pytest -q -rs tests/python
  step demo-cuda 60 python3 -m usmipc demo --device cuda:gpu
fi
summary
