#!/usr/bin/env bash
# GPU run 58 (issues 23, 24), one call of at most 600 s: build; the release
# ticket's idle-queue test on cuda; the reducer, bundle and to="torch" GPU
# tests; usmipc.torch against torch (bench, profile); bench_weights.py's
# Qwen2.5-1.5B handoff and update, every system side by side.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run58.log") 2>&1
t0=$SECONDS
nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader
python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
git log --oneline -1 2>/dev/null
cmake -S . -B build-gpu -DUSMIPC_WERROR=ON > /dev/null && cmake --build build-gpu -j 16 > /dev/null || echo BUILD FAILED
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo PIP FAILED
echo "== built at $((SECONDS-t0)) s"
for t in bundle_release_idle_queue_reuses_record bundle_release_same_process bundle_release_cross_process bundle_release_fanout event_order_reuses_completed_record event_complete_record_not_waited; do
  for k in fd native; do
    USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=$k timeout 30 build-gpu/tests/c/usmipc_tests $t > /tmp/t.log 2>&1
    echo "c $t $k rc=$?"; grep -i "fail\|skip" /tmp/t.log | head -3
  done
done
echo "== C tests done at $((SECONDS-t0)) s"
timeout 150 python3 -m pytest -q -rs tests/gpu/test_gpu_torch_reducers.py tests/gpu/test_gpu_bundles.py tests/gpu/test_bundles_to_torch.py 2>&1 | tail -8
echo "== pytest done at $((SECONDS-t0)) s"
timeout 60 python3 tests/gpu/torch_mp_bench.py --rounds 7 --json "$OUT/torch_mp_bench.json" 2>&1 | tail -25
echo "== torch_mp_bench done at $((SECONDS-t0)) s"
for m in usmipc torch; do
  timeout 30 python3 tests/gpu/torch_mp_profile.py --mode $m --n 200 > "$OUT/torch_mp_profile_$m.log" 2>&1; grep -v "^ \|ncalls\|^---" "$OUT/torch_mp_profile_$m.log" | tail -30
done
echo "== torch_mp_profile done at $((SECONDS-t0)) s"
bw() { # bw NAME TIMEOUT ARGS...: bench_weights.py, its log and JSON in $OUT
  local n=$1 lim=$2; shift 2
  timeout "$lim" python3 bench/bench_weights.py "$@" --json "$OUT/bw_$n.json" > "$OUT/bw_$n.log" 2>&1
  echo "rc $?"; grep -v Warn "$OUT/bw_$n.log" | grep -v "usmipc.stats() summed" | tail -30
  echo "== bench_weights $n done at $((SECONDS-t0)) s"
}
bw qwen 150 --reps 3 --warm 3
bw qwen_update 120 --update --reps 3 --warm 3
