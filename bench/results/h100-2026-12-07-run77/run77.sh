#!/usr/bin/env bash
# GPU run 77 (issues 24, 23), one call under 10 minutes, most needed first:
# torch_mp_bench at HEAD (A) beside 2efb9c3 (C: before this and the last
# stop's C paths), A C A; GPU reducer tests; PyTorch's CUDA tests that send
# tensors (test_cuda_send_many included); per_tensor_bench qwen; fan-out
# with the machine's cpu_ratio. A step starts only with time left for it.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run77.log") 2>&1
t0=$SECONDS
LIMIT=${LIMIT:-585}
left() { [ $((SECONDS - t0 + $1)) -lt "$LIMIT" ]; }
nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader
tmb_sum() { python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for case in ("tensor_fresh", "tensor_repeated", "state_dict_cold", "state_dict_warm"):
    t, u = d["torch"][case], d["usmipc"][case]
    print(f"{case}: torch p+r {t['pickle_rebuild_ms']:.3f} (d {t['dumps_ms']:.3f} l {t['loads_ms']:.3f}) | usmipc p+r {u['pickle_rebuild_ms']:.3f} (d {u['dumps_ms']:.3f} l {u['loads_ms']:.3f}) | ratio {u['pickle_rebuild_ms'] / t['pickle_rebuild_ms']:.3f}, e2e {u['end_to_end_ms'] / t['end_to_end_ms']:.2f}")
PY
}
root=$PWD
i=0
tmb() {
  v=$1; i=$((i+1))
  left 70 || { echo "SKIP tmb $v"; return; }
  dir=$root; [ $v = A ] || dir=$root/.carry/ab/$v
  (cd "$dir" && python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1) || echo "PIP FAILED $v"
  timeout 70 python3 tests/gpu/torch_mp_bench.py --rounds 15 --json "$OUT/tmb_${i}$v.json" > "$OUT/tmb_${i}$v.log" 2>&1; echo "tmb $v rc $?"
  tmb_sum "$OUT/tmb_${i}$v.json"
  echo "== tmb $v done at $((SECONDS-t0)) s"
}
tmb A
python3 -m pip install -q --no-index --no-deps .carry/wheels/expecttest-*.whl > /dev/null 2>&1 || echo "EXPECTTEST FAILED"
if left 90; then
  timeout 90 python3 -m pytest -q -rs tests/gpu/test_gpu_torch_reducers.py 2>&1 | tail -4
  echo "== pytest reducers done at $((SECONDS-t0)) s"
fi
if left 170; then
  PYTORCH_TEST_WITH_SLOW=1 PER_TEST=110 PY=python3 OUT="$OUT/torch_mp" timeout 170 bash tests/torch_mp/run.sh \
    TestMultiprocessing.test_cuda_send_many TestMultiprocessing.test_cuda_simple \
    TestMultiprocessing.test_cuda_variable_sharing TestMultiprocessing.test_cuda_parameter_sharing \
    TestMultiprocessing.test_mixed_types_cuda_sharing TestMultiprocessing.test_cuda_small_tensors \
    TestMultiprocessing.test_event_multiprocess > "$OUT/torch_mp.log" 2>&1
  echo "torch tests rc $?"; cat "$OUT/torch_mp/tests.txt" 2>/dev/null; cat "$OUT"/torch_mp/stats*.txt 2>/dev/null | tail -5
  echo "== torch tests done at $((SECONDS-t0)) s"
fi
if ! left 170 && left 80; then  # a short lease: the slow one alone
  PYTORCH_TEST_WITH_SLOW=1 PER_TEST=75 PY=python3 OUT="$OUT/torch_mp" timeout 80 bash tests/torch_mp/run.sh \
    TestMultiprocessing.test_cuda_send_many > "$OUT/torch_mp.log" 2>&1
  echo "torch send_many rc $?"; cat "$OUT/torch_mp/tests.txt" 2>/dev/null; cat "$OUT"/torch_mp/stats*.txt 2>/dev/null | tail -5
fi
tmb C
tmb A
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo "PIP FAILED HEAD"
if left 45; then
  timeout 45 python3 tests/gpu/per_tensor_bench.py --layout qwen --json "$OUT/per_tensor_qwen.json" 2>&1 | tail -12; echo "pt qwen rc $?"
  echo "== per tensor done at $((SECONDS-t0)) s"
fi
if left 60; then
  timeout 60 python3 tests/gpu/fanout_bench.py --consumers 8 --rounds 8 --json "$OUT/fanout.json" > "$OUT/fanout.log" 2>&1
  echo "fanout rc $?"; tail -24 "$OUT/fanout.log"
  echo "== fanout done at $((SECONDS-t0)) s"
fi
(cd "$OUT" && tar czf run77.tgz tmb_* per_tensor_* fanout.* torch_mp* 2>/dev/null && rm -rf tmb_* per_tensor_* fanout.* torch_mp.log)
echo "== all done at $((SECONDS-t0)) s"
