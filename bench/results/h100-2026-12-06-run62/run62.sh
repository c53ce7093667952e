#!/usr/bin/env bash
# GPU run 62 (issues 23, 24), one call: the cold floor with each bundle's
# own allocations (bench_weights' kept methods); the one-call update's copy
# kernel: chunk sizes (USMIPC_COPY_CHUNK_KIB), then a kernel with 8 loads
# in flight per thread instead of 4 (exp/, not committed), Qwen and MoE;
# the rest of PyTorch's CUDA tests of test_multiprocessing.py.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run62.log") 2>&1
t0=$SECONDS
nvidia-smi -L
cmake -S . -B build-gpu -DUSMIPC_WERROR=ON > /dev/null && cmake --build build-gpu -j 16 > /dev/null || echo BUILD FAILED
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo PIP FAILED
echo "== built at $((SECONDS-t0)) s"
timeout 100 python3 bench/bench_weights.py --reps 4 --warm 3 --methods i,j,l --json "$OUT/bw_qwen_kept.json" > "$OUT/bw_qwen_kept.log" 2>&1
echo "rc $?"; grep "^|\|against the target\|the Pipe alone" "$OUT/bw_qwen_kept.log"
echo "== bench_weights done at $((SECONDS-t0)) s"
ub() { # ub NAME ARGS...
  local n=$1; shift
  timeout 60 python3 tests/gpu/update_bench.py --rounds 8 "$@" --json "$OUT/update_$n.json" > "$OUT/update_$n.log" 2>&1
  echo "$n rc $? $(python3 -c "import json;d=json.load(open('$OUT/update_$n.json'));print('flat %.3f update %.3f ratio %.3f host us/leaf %.2f bad %s' % (d['flat_copy_ms'], d['update_consumer_ms'], d['update_over_flat'], d['host_us_per_leaf'], d['bad_rounds']))" 2>&1 | tail -1)"
}
for c in 1024 4096 256 1024; do USMIPC_COPY_CHUNK_KIB=$c ub qwen_chunk$c --layout qwen; done
ub moe_chunk1024 --layout moe
echo "== chunk sweep done at $((SECONDS-t0)) s"
cp exp/copy_batch_ptx_unroll8.h src/backend/kernels/copy_batch_ptx.h
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo PIP FAILED
ub qwen_unroll8 --layout qwen
ub moe_unroll8 --layout moe
ub qwen_unroll8b --layout qwen
git checkout src/backend/kernels/copy_batch_ptx.h 2>/dev/null
echo "== kernel variant done at $((SECONDS-t0)) s"
timeout 200 env PER_TEST=60 PY=python3 OUT="$OUT/torch_mp" bash tests/torch_mp/run.sh TestMultiprocessing.test_cuda_send_many TestMultiprocessing.test_cuda_bad_call TestMultiprocessing.test_cuda_ipc_deadlock TestMultiprocessing.test_empty_tensor_sharing_cuda TestMultiprocessing.test_integer_parameter_serialization_cuda TestMultiprocessing.test_event_handle_importer 2>&1 | tail -12
rm -rf "$OUT/torch_mp/stats"
echo "== torch CUDA tests done at $((SECONDS-t0)) s"
