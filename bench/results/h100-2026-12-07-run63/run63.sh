#!/usr/bin/env bash
# GPU run 63 (issues 23, 24), call 1: build; the GPU suites of what stop 36
# changed (usmipc.torch's dumps and receiver, bench_weights' cold floor);
# torch_mp_bench; the one-call update's kernel: the device's time alone
# (a stream spin hides the call's host work; events time the rest) beside
# the flat copy timed the same ways, and kernel variants (experiment, not
# committed: plain loads and stores, a resident grid, chunk sizes).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run63.log") 2>&1
t0=$SECONDS
nvidia-smi -L; nvidia-smi --query-gpu=driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
cmake -S . -B build-gpu -DUSMIPC_WERROR=ON > /dev/null && cmake --build build-gpu -j 16 > /dev/null || echo BUILD FAILED
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo PIP FAILED
echo "== built at $((SECONDS-t0)) s"
timeout 150 python3 -m pytest -q -rs tests/gpu/test_gpu_torch_reducers.py tests/gpu/test_gpu_bundles.py tests/gpu/test_bundles_to_torch.py tests/gpu/test_gpu_update.py tests/gpu/test_gpu_events.py 2>&1 | tail -8
echo "== pytest done at $((SECONDS-t0)) s"
timeout 90 python3 bench/bench_weights.py --reps 4 --warm 3 --methods i,j,l --json "$OUT/bw_qwen_kept.json" > "$OUT/bw_qwen_kept.log" 2>&1
echo "rc $?"; grep "^|\|against the target\|the Pipe alone\|warm: export" "$OUT/bw_qwen_kept.log"
echo "== bench_weights done at $((SECONDS-t0)) s"
timeout 100 python3 bench/bench_weights.py --layout moe --reps 1 --warm 5 --methods j --json "$OUT/bw_moe_pool.json" > "$OUT/bw_moe_pool.log" 2>&1
echo "rc $?"; grep "^|\|the Pipe alone\|warm: export" "$OUT/bw_moe_pool.log"
echo "== bench_weights moe done at $((SECONDS-t0)) s"
timeout 60 python3 tests/gpu/torch_mp_bench.py --rounds 15 --json "$OUT/torch_mp_bench.json" 2>&1 | tail -22
echo "== torch_mp_bench done at $((SECONDS-t0)) s"
ub() { # ub NAME ARGS...
  local n=$1; shift
  timeout 70 python3 tests/gpu/update_bench.py --rounds 6 "$@" --json "$OUT/update_$n.json" > "$OUT/update_$n.log" 2>&1
  echo "$n rc $? $(python3 -c "
import json;d=json.load(open('$OUT/update_$n.json'))
print('flat %.3f idle %.3f gpu %.3f | update %.3f gpu %.3f | x %.3f idle-x %.3f gpu-x %.3f | call %.3f rel %s bad %s' % (d['flat_copy_ms'], d['flat_idle_ms'], d['flat_gpu_ms'], d['update_consumer_ms'], d['update_gpu_ms'], d['update_over_flat'], d['update_over_flat_idle'], d['update_gpu_over_flat_gpu'], d['update_call_host_ms'], d['release_call_host_ms'], d['bad_rounds']))" 2>&1 | tail -1)"
  grep "usmipc experiment" "$OUT/update_$n.log" | head -1
}
ub qwen_default --layout qwen
ub qwen_late --layout qwen --late-release
USMIPC_COPY_KERNEL=usmipc_copy_chunks_plain ub qwen_plain --layout qwen
USMIPC_COPY_KERNEL=usmipc_copy_persist_plain USMIPC_COPY_CHUNK_KIB=64 ub qwen_persist_plain64 --layout qwen
echo "== update variants qwen done at $((SECONDS-t0)) s"
echo "== update variants moe done at $((SECONDS-t0)) s"
(cd "$OUT" && tar czf update_runs.tgz update_* && rm -f update_*.json update_*.log)
