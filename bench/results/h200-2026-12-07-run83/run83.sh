#!/usr/bin/env bash
# GPU run 83 (issues 23, 24), stop 42: the foreign-export index (17815b9)
# on the per-tensor share(): per_tensor_bench qwen and moe at the working
# tree (A) beside 7bcd874 (O: exports found by walking a list), A O A O;
# then run 82's parts: strace of warm opens (qwen, moe), the GPU reducer
# tests, PyTorch's event test and two more, torch_mp_bench, fan-out with
# --unordered-too. A step starts only with time left for it.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run83.log") 2>&1
t0=$SECONDS
LIMIT=${LIMIT:-585}
left() { [ $((SECONDS - t0 + $1)) -lt "$LIMIT" ]; }
nvidia-smi -L
command -v strace > /dev/null || { export PATH=$PWD/.carry/strace:$PATH LD_LIBRARY_PATH=$PWD/.carry/strace/lib:${LD_LIBRARY_PATH:-}; }
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
python3 -m pip install -q --no-index --no-deps .carry/wheels/expecttest-*.whl > /dev/null 2>&1 || echo "EXPECTTEST FAILED"
strace -V | head -1 || echo "NO STRACE"
for layout in qwen moe; do
  left 90 || break
  timeout 90 python3 tests/gpu/warm_open_strace.py --layout $layout --rounds 20 --out "$OUT/strace_$layout.txt" 2>&1 | tail -3
  echo "== strace $layout done at $((SECONDS-t0)) s"
done
if left 90; then
  timeout 90 python3 -m pytest -q -rs tests/gpu/test_gpu_torch_reducers.py 2>&1 | tail -4
  echo "== pytest reducers done at $((SECONDS-t0)) s"
fi
if left 120; then
  PYTORCH_TEST_WITH_SLOW=1 PER_TEST=60 PY=python3 OUT="$OUT/torch_mp" timeout 120 bash tests/torch_mp/run.sh \
    TestMultiprocessing.test_event_multiprocess TestMultiprocessing.test_cuda_simple \
    TestMultiprocessing.test_mixed_types_cuda_sharing > "$OUT/torch_mp.log" 2>&1
  echo "torch tests rc $?"; cat "$OUT/torch_mp/tests.txt" 2>/dev/null
  echo "== torch tests done at $((SECONDS-t0)) s"
fi
if left 60; then
  timeout 60 python3 tests/gpu/torch_mp_bench.py --rounds 15 --json "$OUT/tmb.json" > "$OUT/tmb.log" 2>&1; echo "tmb rc $?"
  grep -i "warm\|repeated" "$OUT/tmb.log" | head -6
fi
if left 90; then
  timeout 90 python3 tests/gpu/fanout_bench.py --consumers 8 --rounds 8 --unordered-too --no-raw --json "$OUT/fanout.json" > "$OUT/fanout.log" 2>&1
  echo "fanout rc $?"; tail -30 "$OUT/fanout.log" | grep -v "^ *\"raw\|^ *\"segments"
fi
(cd "$OUT" && tar czf run83.tgz pt_* strace_* tmb* fanout.* torch_mp* 2>/dev/null && rm -rf pt_* strace_* tmb* fanout.* torch_mp.log torch_mp/stats)
echo "== all done at $((SECONDS-t0)) s"
