#!/usr/bin/env bash
# A short check of usmipc.torch after a change, for a lease with about five
# minutes left: install, the GPU reducer tests, the profiles (usmipc, then
# torch), the speed comparison with 5 rounds, and PyTorch's CUDA tests of
# test_multiprocessing.py that share tensors (tests/torch_mp/run.sh; carry
# .carry/). Logs as run.sh's.
#   OUT=dir bash tests/gpu/torch_mp_verify.sh
. "$(dirname "$0")/steps.sh" gpu-torch-mp-verify
step pip 60 install
step pytest-torch-reducers 90 python3 -m pytest -q -rs tests/gpu/test_gpu_torch_reducers.py
step profile-usmipc 30 python3 tests/gpu/torch_mp_profile.py --mode usmipc --n 200 --quiet
step profile-torch 30 python3 tests/gpu/torch_mp_profile.py --mode torch --n 200 --quiet
step torch-mp-bench 40 python3 tests/gpu/torch_mp_bench.py --rounds 5 --json "$OUT/torch_mp_bench.json"
step torch-cuda-tests 150 env PER_TEST=90 PY=python3 OUT="$OUT/torch_mp" bash tests/torch_mp/run.sh TestMultiprocessing.test_cuda_simple TestMultiprocessing.test_cuda_parameter_sharing TestMultiprocessing.test_cuda_variable_sharing TestMultiprocessing.test_mixed_types_cuda_sharing TestMultiprocessing.test_cuda_memory_allocation TestMultiprocessing.test_is_shared_cuda TestMultiprocessing.test_event_multiprocess TestMultiprocessing.test_cuda_send_many
summary
exit $status
