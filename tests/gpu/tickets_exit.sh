#!/usr/bin/env bash
# Release tickets whose consumers exit (issue 21 #2) on the GPU machine:
# builds and installs, then runs tests/gpu/tickets_exit.py with both CUDA
# IPC kinds, and the C and Level Zero-free parts of the suite that cover it.
#   OUT=/tmp/out bash tests/gpu/tickets_exit.sh
set -u
OUT=${OUT:-/tmp/usmipc-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cmake -S . -B build-gpu -DUSMIPC_WERROR=ON > /dev/null && cmake --build build-gpu -j 16 > /dev/null || echo BUILD FAILED
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo PIP FAILED
for t in event_release_consumer_exits bundle_release_consumer_exits event_release_ticket_own_capability event_timeout_no_wrap; do
  USMIPC_TEST_DEVICE=cuda:gpu:0 timeout 120 build-gpu/tests/c/usmipc_tests $t > /tmp/t.log 2>&1
  rc=$?; echo "c.$t cuda rc=$rc"; [ $rc = 0 ] || [ $rc = 77 ] || tail -5 /tmp/t.log
done
for k in fd native; do
  USMIPC_CUDA_IPC=$k timeout 400 python3 tests/gpu/tickets_exit.py 2>&1 | tee "$OUT/tickets_exit_$k.txt"
done
