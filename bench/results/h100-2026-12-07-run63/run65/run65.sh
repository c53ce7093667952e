#!/usr/bin/env bash
# GPU run 64: usmipc.torch's figures moved between run 60 (a08c032) and
# run 63 (781c69a + the update-kernel experiment) on another H100: the same
# bench (tests/gpu/torch_mp_bench.py of HEAD) over three builds on one
# machine, C = a08c032 (run 60's), B = d4f3361 (stop 36's last), A = this
# tree; then the GPU tests run 63's time limit cut.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run65.log") 2>&1
t0=$SECONDS
nvidia-smi -L
root=$PWD
for v in D E F; do
  dir=$root; [ $v = A ] || dir=$root/.carry/ab/$v
  (cd "$dir" && python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1) || echo "PIP FAILED $v"
  echo "== $v installed at $((SECONDS-t0)) s"
  timeout 70 python3 tests/gpu/torch_mp_bench.py --rounds 15 --json "$OUT/tmb_$v.json" > "$OUT/tmb_$v.log" 2>&1; echo "rc $?"
  python3 - "$OUT/tmb_$v.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for case in ("tensor_fresh", "tensor_repeated", "state_dict_cold", "state_dict_warm"):
    t, u = d["torch"][case], d["usmipc"][case]
    print(f"{case}: torch p+r {t['pickle_rebuild_ms']:.3f} (d {t['dumps_ms']:.3f} l {t['loads_ms']:.3f}) | usmipc p+r {u['pickle_rebuild_ms']:.3f} (d {u['dumps_ms']:.3f} l {u['loads_ms']:.3f}) | ratio {u['pickle_rebuild_ms'] / t['pickle_rebuild_ms']:.2f}, e2e {u['end_to_end_ms'] / t['end_to_end_ms']:.2f}")
PY
  echo "== $v done at $((SECONDS-t0)) s"
done
echo "== pytest done at $((SECONDS-t0)) s"
(cd "$OUT" && tar czf tmb.tgz tmb_* && rm -f tmb_*)
