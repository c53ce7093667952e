#!/usr/bin/env bash
# Issue 24's open GPU findings of run 47, looked at in one call: where the
# pickling time goes (torch_mp_profile.py, usmipc beside torch), PyTorch's
# test_cuda_send_many checked item by item (torch_mp_send_many.py), the two
# PyTorch tests that failed or hung (a hang prints every process's stack),
# and the GPU reducer tests. Carry .carry/.
#   OUT=dir bash tests/gpu/torch_mp_diag.sh
. "$(dirname "$0")/steps.sh" gpu-torch-mp-diag
step pip 90 install
step profile-usmipc 90 python3 tests/gpu/torch_mp_profile.py --mode usmipc --n 200
step profile-torch 60 python3 tests/gpu/torch_mp_profile.py --mode torch --n 200 --quiet
step send-many-2hops 60 env USMIPC_TORCH=1 PYTHONFAULTHANDLER=1 timeout -s ABRT 50 python3 tests/gpu/torch_mp_send_many.py --hops 2 --count 20000
step send-many-3hops 100 env USMIPC_TORCH=1 PYTHONFAULTHANDLER=1 timeout -s ABRT 90 python3 tests/gpu/torch_mp_send_many.py --hops 3 --count 100000
step torch-tests-2 230 env PER_TEST=150 PY=python3 OUT="$OUT/torch_mp" bash tests/torch_mp/run.sh TestMultiprocessing.test_cuda_send_many TestMultiprocessing.test_event_multiprocess
step pytest-torch-reducers 120 python3 -m pytest -q -rs -x tests/gpu/test_gpu_torch_reducers.py
summary
exit $status
