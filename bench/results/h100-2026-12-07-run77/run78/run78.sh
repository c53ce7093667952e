#!/usr/bin/env bash
# GPU run 78 (issues 24, 23), after run 77 on the same session: PyTorch's
# CUDA tests other than those run 77 ran, the GPU bundle/update suites
# (bundle.c's share_read), bench_weights cold floors with the C bench
# built, per_tensor_bench moe. A step starts only with time left for it.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run78.log") 2>&1
t0=$SECONDS
LIMIT=${LIMIT:-585}
left() { [ $((SECONDS - t0 + $1)) -lt "$LIMIT" ]; }
nvidia-smi -L
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo PIP FAILED
python3 -m pip install -q --no-index --no-deps .carry/wheels/expecttest-*.whl > /dev/null 2>&1 || echo "EXPECTTEST FAILED"
echo "== installed at $((SECONDS-t0)) s"
if left 200; then
PYTORCH_TEST_WITH_SLOW=1 PER_TEST=60 PY=python3 OUT="$OUT/torch_mp" timeout 200 bash tests/torch_mp/run.sh \
  TestMultiprocessing.test_cuda_memory_allocation TestMultiprocessing.test_is_shared_cuda \
  TestMultiprocessing.test_empty_tensor_sharing_cuda TestMultiprocessing.test_integer_parameter_serialization_cuda TestMultiprocessing.test_event \
  TestMultiprocessing.test_event_handle_multi_gpu TestMultiprocessing.test_event_handle_importer \
  TestMultiprocessing.test_event_handle_exporter TestMultiprocessing.test_cuda_bad_call \
  TestMultiprocessing.test_cuda_ipc_deadlock TestMultiprocessing.test_wrong_cuda_fork > "$OUT/torch_mp.log" 2>&1
echo "torch tests rc $?"
cat "$OUT/torch_mp/tests.txt" 2>/dev/null | tail -30; cat "$OUT"/torch_mp/stats.txt 2>/dev/null | tail -2
echo "== torch tests done at $((SECONDS-t0)) s"
fi
if left 150; then
timeout 150 python3 -m pytest -q -rs tests/gpu/test_gpu_bundles.py tests/gpu/test_bundles_to_torch.py tests/gpu/test_gpu_update.py 2>&1 | tail -5
echo "== pytest done at $((SECONDS-t0)) s"
fi
if left 170; then
(cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null && cmake --build build-gpu --target usmipc_bench_cold_floor > /dev/null) || echo "COLD FLOOR BUILD FAILED"
echo "== cold floor built at $((SECONDS-t0)) s"
timeout 150 python3 bench/bench_weights.py --reps 3 --warm 3 --methods i,j,l --json "$OUT/bw_cold.json" > "$OUT/bw_cold.log" 2>&1
echo "bw rc $?"; grep "^|\|against the target\|cold floor\|floor" "$OUT/bw_cold.log" | head -30
echo "== bw done at $((SECONDS-t0)) s"
fi
if left 100; then
timeout 100 python3 tests/gpu/per_tensor_bench.py --layout moe --reps 5 --json "$OUT/per_tensor_moe.json" 2>&1 | tail -4; echo "pt moe rc $?"
echo "== per tensor moe done at $((SECONDS-t0)) s"
fi
(cd "$OUT" && tar czf run78.tgz per_tensor_* bw_cold.* torch_mp* 2>/dev/null && rm -rf per_tensor_* bw_cold.* torch_mp.log torch_mp/stats)
echo "== all done at $((SECONDS-t0)) s"
