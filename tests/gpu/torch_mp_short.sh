#!/usr/bin/env bash
# The torch-mp subset of tests/gpu/run.sh under tighter limits, for a lease
# with one call left (about 9 minutes in all): install, the GPU reducer
# tests, PyTorch's test_multiprocessing.py (tests/torch_mp/run.sh; carry
# .carry/), the speed comparison with 7 rounds and the profiles of
# torch_mp_profile.py (usmipc, then torch). Logs as run.sh's.
#   OUT=dir bash tests/gpu/torch_mp_short.sh
. "$(dirname "$0")/steps.sh" gpu-torch-mp-short
step pip 60 install
step pytest-torch-reducers 120 python3 -m pytest -q -rs tests/gpu/test_gpu_torch_reducers.py
step profile-usmipc 45 python3 tests/gpu/torch_mp_profile.py --mode usmipc --n 200
step profile-torch 45 python3 tests/gpu/torch_mp_profile.py --mode torch --n 200 --quiet
step torch-mp-bench 70 python3 tests/gpu/torch_mp_bench.py --rounds 7 --json "$OUT/torch_mp_bench.json"
step torch-test-multiprocessing 280 env PER_TEST=150 PY=python3 OUT="$OUT/torch_mp" bash tests/torch_mp/run.sh
summary
exit $status
