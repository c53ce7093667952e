#!/usr/bin/env bash
# GPU run 55 (issue 23 items 4-5, issue 24): build, the C event tests on
# cuda (fd, native), tests/gpu/test_gpu_events.py, fan-out (8 consumers,
# with the bare driver's beside it), the GPU update/bundle/reducer suites,
# torch_mp_bench.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run55.log") 2>&1
t0=$SECONDS
nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader
python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
cmake -S . -B build-gpu -DUSMIPC_WERROR=ON > /dev/null && cmake --build build-gpu -j 16 > /dev/null || echo BUILD FAILED
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo PIP FAILED
echo "== built at $((SECONDS-t0)) s"
for t in $(grep -o 'X(event_[a-z_]*)' tests/c/test_list.h | sed 's/X(\(.*\))/\1/'); do
  for k in fd native; do
    USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=$k timeout 60 build-gpu/tests/c/usmipc_tests $t > /tmp/t.log 2>&1
    rc=$?; [ $rc = 0 ] || [ $rc = 77 ] || { echo "c $t $k rc=$rc"; tail -5 /tmp/t.log; }
  done
done
echo "== C event tests done at $((SECONDS-t0)) s (only failures listed)"
USMIPC_EVENT_TRIALS=30 timeout 200 python3 -m pytest -q -rs tests/gpu/test_gpu_events.py 2>&1 | tail -5
echo "== test_gpu_events done at $((SECONDS-t0)) s"
timeout 240 python3 tests/gpu/fanout_bench.py --consumers 8 --layout qwen --rounds 7 --json "$OUT/fanout_qwen.json" 2>&1 | grep -v Warn | tail -22
echo "== fanout done at $((SECONDS-t0)) s"
timeout 200 python3 -m pytest -q -rs tests/gpu/test_gpu_update.py tests/gpu/test_gpu_bundles.py tests/gpu/test_gpu_torch_reducers.py 2>&1 | tail -6
echo "== gpu suites done at $((SECONDS-t0)) s"
timeout 150 python3 tests/gpu/torch_mp_bench.py --rounds 7 --json "$OUT/torch_mp_bench.json" 2>&1 | tail -25
echo "== torch_mp_bench done at $((SECONDS-t0)) s"
