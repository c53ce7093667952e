#!/usr/bin/env bash
# GPU run 79 (issue 24): the receiver's step in C (torch_rebuild.c).
# torch_mp_bench at the working tree (A) beside d9e6ea7 (D: the receiver
# in Python), A D A D; GPU reducer tests; PyTorch's CUDA tests that load
# tensors. A step starts only with time left for it.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run81.log") 2>&1
t0=$SECONDS
LIMIT=${LIMIT:-585}
left() { [ $((SECONDS - t0 + $1)) -lt "$LIMIT" ]; }
nvidia-smi -L
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
  left 60 || { echo "SKIP tmb $v"; return; }
  dir=$root; [ $v = A ] || dir=$root/.carry/ab/$v
  (cd "$dir" && python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1) || echo "PIP FAILED $v"
  timeout 60 python3 tests/gpu/torch_mp_bench.py --rounds 15 --json "$OUT/tmb_${i}$v.json" > "$OUT/tmb_${i}$v.log" 2>&1; echo "tmb $v rc $?"
  tmb_sum "$OUT/tmb_${i}$v.json"
  echo "== tmb $v done at $((SECONDS-t0)) s"
}
tmb D; tmb A; tmb D; tmb A; exit 0
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo "PIP FAILED HEAD"
python3 -m pip install -q --no-index --no-deps .carry/wheels/expecttest-*.whl > /dev/null 2>&1 || echo "EXPECTTEST FAILED"
if left 90; then
  timeout 90 python3 -m pytest -q -rs tests/gpu/test_gpu_torch_reducers.py 2>&1 | tail -4
  echo "== pytest reducers done at $((SECONDS-t0)) s"
fi
if left 200; then
  PYTORCH_TEST_WITH_SLOW=1 PER_TEST=100 PY=python3 OUT="$OUT/torch_mp" timeout 200 bash tests/torch_mp/run.sh \
    TestMultiprocessing.test_cuda_send_many TestMultiprocessing.test_cuda_simple \
    TestMultiprocessing.test_cuda_variable_sharing TestMultiprocessing.test_cuda_parameter_sharing \
    TestMultiprocessing.test_mixed_types_cuda_sharing TestMultiprocessing.test_cuda_small_tensors \
    TestMultiprocessing.test_is_shared_cuda TestMultiprocessing.test_empty_tensor_sharing_cuda \
    TestMultiprocessing.test_cuda_ipc_deadlock TestMultiprocessing.test_event_multiprocess > "$OUT/torch_mp.log" 2>&1
  echo "torch tests rc $?"; cat "$OUT/torch_mp/tests.txt" 2>/dev/null; cat "$OUT"/torch_mp/stats.txt 2>/dev/null | tail -1
  echo "== torch tests done at $((SECONDS-t0)) s"
fi
(cd "$OUT" && tar czf run79.tgz tmb_* torch_mp* 2>/dev/null && rm -rf tmb_* torch_mp.log torch_mp/stats)
echo "== all done at $((SECONDS-t0)) s"
