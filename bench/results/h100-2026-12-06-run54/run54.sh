#!/usr/bin/env bash
# GPU run 54 (issue 23 item 5): build, the C event tests on cuda (fd,
# native), tests/gpu/test_gpu_events.py, export_bench with reuse on/off
# side by side, then the GPU bundle/reducer/cuda suites.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run54.log") 2>&1
t0=$SECONDS
nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader
python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
git log --oneline -1 2>/dev/null || true
cmake -S . -B build-gpu -DUSMIPC_WERROR=ON > /dev/null && cmake --build build-gpu -j 16 > /dev/null || echo BUILD FAILED
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo PIP FAILED
echo "== built at $((SECONDS-t0)) s"
for t in $(grep -o 'X(event_[a-z_]*)' tests/c/test_list.h | sed 's/X(\(.*\))/\1/'); do
  for k in fd native; do
    USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=$k timeout 60 build-gpu/tests/c/usmipc_tests $t > /tmp/t.log 2>&1
    rc=$?; echo "c $t $k rc=$rc"; [ $rc = 0 ] || [ $rc = 77 ] || tail -5 /tmp/t.log
  done
done
echo "== C event tests done at $((SECONDS-t0)) s"
USMIPC_EVENT_TRIALS=30 timeout 240 python3 -m pytest -q -rs tests/gpu/test_gpu_events.py 2>&1 | tail -8
echo "== test_gpu_events done at $((SECONDS-t0)) s"
for r in 1 0 1 0; do
  USMIPC_ORDER_REUSE=$r timeout 90 python3 tests/gpu/export_bench.py --k 500 --rounds 7 --json "$OUT/export_reuse${r}_$SECONDS.json" 2>&1 | grep -v Deprecation
done
echo "== export_bench done at $((SECONDS-t0)) s"
timeout 200 python3 -m pytest -q -rs tests/gpu/test_gpu_bundles.py tests/gpu/test_gpu_torch_reducers.py tests/gpu/test_cuda.py 2>&1 | tail -8
echo "== gpu suites done at $((SECONDS-t0)) s"
