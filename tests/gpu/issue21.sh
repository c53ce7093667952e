#!/usr/bin/env bash
# The GPU runs of issue 21 (the second attack round's defects), in halves
# that each fit one device call:
#
#   OUT=/tmp/out bash tests/gpu/issue21.sh a   build, install, the C suite
#       on CUDA (fd, native), tests/gpu/tickets_exit.py with both kinds
#       (consumers that exit or are SIGKILLed after returning tickets)
#   OUT=/tmp/out bash tests/gpu/issue21.sh b   build, install,
#       tests/gpu/test_bundles.py, test_events.py, test_cuda.py, the
#       mutation tests and bundle tests of tests/python, the demo
#
# Every step runs even if one fails; logs to $OUT/issue21-<half>.log and a
# summary line per step (tests/gpu/steps.sh).
half=${1:-a}
. "$(dirname "$0")/steps.sh" "issue21-$half"

step build 300 build
step pip 180 install
if [ "$half" = a ]; then
  step c-cuda-fd 240 env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=fd build-gpu/tests/c/usmipc_tests
  step c-cuda-native 240 env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=native build-gpu/tests/c/usmipc_tests
  step tickets-exit-fd 200 env USMIPC_CUDA_IPC=fd python3 tests/gpu/tickets_exit.py
  step tickets-exit-native 200 env USMIPC_CUDA_IPC=native python3 tests/gpu/tickets_exit.py
fi
if [ "$half" = b ]; then
  step bundles 200 python3 -m pytest -q -rs tests/gpu/test_bundles.py
  step events 200 python3 -m pytest -q -rs tests/gpu/test_events.py
  step test-cuda 240 python3 -m pytest -q -rs tests/gpu/test_cuda.py
  step mutation-host 120 python3 -m pytest -q -rs tests/python/test_mutation.py tests/python/test_bundles.py tests/python/test_bundles_release.py tests/python/test_mp_sharing.py
  step demo-cuda 60 python3 -m usmipc demo --device cuda:gpu
fi
summary
