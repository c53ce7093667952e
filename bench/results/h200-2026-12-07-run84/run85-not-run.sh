#!/usr/bin/env bash
# GPU run 85 (issue 23 item 2), stop 42: the foreign-export index and the
# kept whole handle (HEAD, A) beside 7bcd874 (O), per_tensor_bench qwen and
# moe, A O A O, then cuda-one once; the GPU tests that export caching-
# allocator memory (share queries with a segment freed and reallocated,
# bundles, reducers).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run85.log") 2>&1
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
pt A; pt O; pt A; pt O
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo "PIP FAILED HEAD"
for layout in qwen moe; do
  left 45 || break
  timeout 45 python3 tests/gpu/per_tensor_bench.py --device cuda-one --layout $layout --json "$OUT/pt_one_$layout.json" 2>&1 | grep "^producer"
done
if left 150; then
  timeout 150 python3 -m pytest -q -rs tests/gpu/test_gpu_share_queries.py tests/gpu/test_gpu_bundles.py 2>&1 | tail -4
  echo "== pytest share/bundles done at $((SECONDS-t0)) s"
fi
if left 90; then
  timeout 90 python3 -m pytest -q -rs tests/gpu/test_gpu_torch_reducers.py 2>&1 | tail -4
  echo "== pytest reducers done at $((SECONDS-t0)) s"
fi
(cd "$OUT" && tar czf run85.tgz pt_* 2>/dev/null && rm -rf pt_*)
echo "== all done at $((SECONDS-t0)) s"
