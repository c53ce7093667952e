#!/usr/bin/env bash
# GPU run 60 (issues 23, 24), one call of at most 600 s: build; the GPU
# tests of what stop 35 changed and never ran on a GPU (lazy ready record,
# bare-handle streams, reaper, review mends); usmipc.torch against torch
# (torch_mp_bench.py, no timed round under the profiler now); PyTorch's
# CUDA tests of test_multiprocessing.py that share tensors, with the
# reducers installed in every process; fan-out to 8 consumers.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run60.log") 2>&1
t0=$SECONDS
nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader
python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
cmake -S . -B build-gpu -DUSMIPC_WERROR=ON > /dev/null && cmake --build build-gpu -j 16 > /dev/null || echo BUILD FAILED
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo PIP FAILED
echo "== built at $((SECONDS-t0)) s"
timeout 200 python3 -m pytest -q -rs tests/gpu/test_gpu_torch_reducers.py tests/gpu/test_gpu_bundles.py tests/gpu/test_bundles_to_torch.py tests/gpu/test_gpu_update.py tests/gpu/test_gpu_events.py 2>&1 | tail -12
echo "== pytest done at $((SECONDS-t0)) s"
timeout 60 python3 tests/gpu/torch_mp_bench.py --rounds 15 --json "$OUT/torch_mp_bench.json" 2>&1 | tail -25
echo "== torch_mp_bench done at $((SECONDS-t0)) s"
timeout 200 env PER_TEST=60 PY=python3 OUT="$OUT/torch_mp" bash tests/torch_mp/run.sh TestMultiprocessing.test_cuda_simple TestMultiprocessing.test_cuda_parameter_sharing TestMultiprocessing.test_cuda_variable_sharing TestMultiprocessing.test_mixed_types_cuda_sharing TestMultiprocessing.test_cuda_memory_allocation TestMultiprocessing.test_is_shared_cuda TestMultiprocessing.test_event_multiprocess TestMultiprocessing.test_cuda_send_many TestMultiprocessing.test_cuda_bad_call TestMultiprocessing.test_cuda_ipc_deadlock TestMultiprocessing.test_empty_tensor_sharing_cuda TestMultiprocessing.test_integer_parameter_serialization_cuda TestMultiprocessing.test_event_handle_importer 2>&1 | tail -25
echo "== torch CUDA tests done at $((SECONDS-t0)) s"
timeout 90 python3 tests/gpu/fanout_bench.py --consumers 8 --layout qwen --rounds 6 --json "$OUT/fanout_qwen.json" > "$OUT/fanout_qwen.log" 2>&1; echo "rc $?"; grep -v Warn "$OUT/fanout_qwen.log" | tail -30
echo "== fanout done at $((SECONDS-t0)) s"
