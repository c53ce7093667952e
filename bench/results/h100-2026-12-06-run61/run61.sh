#!/usr/bin/env bash
# GPU run 61 (issue 23), on run 60's warm machine: bench_weights.py's Qwen
# handoff (with the driver's own cold floor and the Pipe floor), update,
# and the MoE's kept handoffs, every system side by side.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run61.log") 2>&1
t0=$SECONDS
nvidia-smi -L
[ -x build-gpu/bench/usmipc_bench_cold_floor ] || { cmake -S . -B build-gpu -DUSMIPC_WERROR=ON > /dev/null && cmake --build build-gpu -j 16 > /dev/null; }
python3 -c 'import usmipc' 2>/dev/null || python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1
bw() { # bw NAME TIMEOUT ARGS...: bench_weights.py, its log and JSON in $OUT
  local n=$1 lim=$2; shift 2
  timeout "$lim" python3 bench/bench_weights.py "$@" --json "$OUT/bw_$n.json" > "$OUT/bw_$n.log" 2>&1
  echo "rc $?"; grep -v Warn "$OUT/bw_$n.log" | grep -v "usmipc.stats() summed" | grep "^|\|cold floor\|against the target\|the Pipe alone" | tail -30
  echo "== bench_weights $n done at $((SECONDS-t0)) s"
}
bw qwen 150 --reps 2 --warm 5
bw qwen_update 110 --update --reps 2 --warm 5
bw moe 200 --layout moe --reps 1 --warm 5 --methods c,d,e,i,j,l
