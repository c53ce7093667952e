#!/usr/bin/env bash
# GPU run 86 (issues 23 item 2 and 24), stop 43: share() and the reducers
# reading a torch tensor through torch's own C readers (the tree of 52a9766, A)
# beside fcff0fd (H, stop 42's end): per_tensor_bench qwen and moe, A H A H;
# cuda-one and torch_mp_bench for H then A; the GPU tests that export
# caching-allocator memory (share queries with a segment freed and
# reallocated, bundles, reducers).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run86.log") 2>&1
t0=$SECONDS
LIMIT=${LIMIT:-585}
left() { [ $((SECONDS - t0 + $1)) -lt "$LIMIT" ]; }
nvidia-smi -L
root=$PWD
i=0
pt() {
  v=$1; i=$((i+1))
  left 60 || { echo "SKIP per_tensor $v"; return; }
  dir=$root; [ $v = A ] || dir=$root/.carry/ab/$v
  (cd "$dir" && python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1) || echo "PIP FAILED $v"
  for layout in qwen moe; do
    timeout 45 python3 tests/gpu/per_tensor_bench.py --layout $layout --json "$OUT/pt_${i}${v}_$layout.json" 2>&1 | grep "^producer"
  done
  echo "== per_tensor $v done at $((SECONDS-t0)) s"
}
pt A; pt H; pt A; pt H
one() {
  v=$1; dir=$root; [ $v = A ] || dir=$root/.carry/ab/$v
  (cd "$dir" && python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1) || echo "PIP FAILED $v"
  for layout in qwen moe; do
    left 45 || break
    timeout 45 python3 tests/gpu/per_tensor_bench.py --device cuda-one --layout $layout --json "$OUT/pt_one_${v}_$layout.json" 2>&1 | grep "^producer"
  done
  echo "== cuda-one $v done at $((SECONDS-t0)) s"
}
tmb() {
  v=$1
  left 70 || { echo "SKIP tmb $v"; return; }
  timeout 65 python3 tests/gpu/torch_mp_bench.py --rounds 15 --json "$OUT/tmb_$v.json" > "$OUT/tmb_$v.log" 2>&1; echo "tmb $v rc $?"
  grep -i "state_dict\|repeated" "$OUT/tmb_$v.log" | head -10
}
one H; tmb H; one A; tmb A
if left 150; then
  timeout 150 python3 -m pytest -q -rs tests/gpu/test_gpu_share_queries.py tests/gpu/test_gpu_bundles.py 2>&1 | tail -4
  echo "== pytest share/bundles done at $((SECONDS-t0)) s"
fi
if left 90; then
  timeout 90 python3 -m pytest -q -rs tests/gpu/test_gpu_torch_reducers.py 2>&1 | tail -4
  echo "== pytest reducers done at $((SECONDS-t0)) s"
fi
(cd "$OUT" && tar czf run86.tgz pt_* tmb_* 2>/dev/null && rm -rf pt_* tmb_*.json)
echo "== all done at $((SECONDS-t0)) s"
