#!/usr/bin/env bash
# GPU run 59 (issue 23), on run 58's warm machine: bench_weights.py's MoE
# handoff and update, every system side by side; fan-out to 8 consumers.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run59.log") 2>&1
t0=$SECONDS
nvidia-smi -L
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo PIP FAILED
bw() {
  local n=$1 lim=$2; shift 2
  timeout "$lim" python3 bench/bench_weights.py "$@" --json "$OUT/bw_$n.json" > "$OUT/bw_$n.log" 2>&1
  echo "rc $?"; grep -v Warn "$OUT/bw_$n.log" | grep -v "usmipc.stats() summed" | grep "^|" | tail -20
  echo "== bench_weights $n done at $((SECONDS-t0)) s"
}
bw moe 190 --layout moe --reps 2 --warm 3
bw moe_update 170 --layout moe --update --reps 2 --warm 3
timeout 150 python3 tests/gpu/fanout_bench.py --consumers 8 --layout qwen --rounds 6 --json "$OUT/fanout_qwen.json" > "$OUT/fanout_qwen.log" 2>&1; echo "rc $?"; grep -v Warn "$OUT/fanout_qwen.log" | tail -30
echo "== fanout done at $((SECONDS-t0)) s"
