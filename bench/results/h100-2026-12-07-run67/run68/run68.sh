#!/usr/bin/env bash
# GPU run 68 (issue 23), at HEAD: the Qwen kept handoffs after 08a9122
# (templates from a bundle's second open), the update through
# bench_weights --update, the MoE pool handoff and update, fan-out.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run68.log") 2>&1
t0=$SECONDS
nvidia-smi -L
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo PIP FAILED
echo "== installed at $((SECONDS-t0)) s"
bw() { # bw NAME TIMEOUT ARGS...
  local n=$1 t=$2; shift 2
  timeout "$t" python3 bench/bench_weights.py "$@" --json "$OUT/bw_$n.json" > "$OUT/bw_$n.log" 2>&1
  echo "bw_$n rc $?"; grep "^|\|against the target\|the Pipe alone\|warm: export\|over the flat\|copy floor" "$OUT/bw_$n.log" | head -30
  echo "== bw_$n done at $((SECONDS-t0)) s"
}
bw qwen_kept 60 --reps 4 --warm 3 --methods i,j,l
bw qwen_update 70 --update --reps 2 --warm 3 --methods i,j,l
bw moe_pool 40 --layout moe --reps 1 --warm 5 --methods j
bw moe_update 100 --layout moe --update --reps 1 --warm 3 --methods i,j
timeout 120 python3 tests/gpu/fanout_bench.py --consumers 8 --rounds 5 --json "$OUT/fanout.json" > "$OUT/fanout.log" 2>&1
echo "fanout rc $?"; tail -15 "$OUT/fanout.log"
echo "== fanout done at $((SECONDS-t0)) s"
(cd "$OUT" && tar czf bw.tgz bw_* fanout.* && rm -f bw_* fanout.*)
