#!/usr/bin/env bash
# GPU run 84 (issue 23 item 2, item 1), stop 42: where the per-tensor
# share() goes on the GPU's machine: per_tensor_bench with every tensor a
# view of one allocation (cuda-one: the per-tensor part alone) beside the
# caching allocator's layouts (cuda), with the driver's query of one
# allocation timed apart; twice each. Then warm_open_strace.py with the
# open's own calls counted apart from the harness's pipe (qwen, moe).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run84.log") 2>&1
t0=$SECONDS
LIMIT=${LIMIT:-585}
left() { [ $((SECONDS - t0 + $1)) -lt "$LIMIT" ]; }
nvidia-smi -L
lscpu | grep -E "Model name|^CPU\(s\)|MHz" | head -4
command -v perf || echo "no perf"
command -v strace > /dev/null || { export PATH=$PWD/.carry/strace:$PATH LD_LIBRARY_PATH=$PWD/.carry/strace/lib:${LD_LIBRARY_PATH:-}; }
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo "PIP FAILED"
for r in 1 2; do
  for dev in cuda-one cuda; do
    for layout in qwen moe; do
      left 45 || break
      timeout 45 python3 tests/gpu/per_tensor_bench.py --device $dev --layout $layout --json "$OUT/pt_${r}_${dev}_$layout.json" 2>&1 | grep "^producer"
    done
  done
  echo "== per_tensor round $r done at $((SECONDS-t0)) s"
done
for layout in qwen moe; do
  left 90 || break
  timeout 90 python3 tests/gpu/warm_open_strace.py --layout $layout --rounds 20 --out "$OUT/strace_$layout.txt" 2>&1 | tail -4
  echo "== strace $layout done at $((SECONDS-t0)) s"
done
(cd "$OUT" && tar czf run84.tgz pt_* strace_* 2>/dev/null && rm -rf pt_* strace_*)
echo "== all done at $((SECONDS-t0)) s"
