#!/usr/bin/env bash
# GPU run 67 (issues 23, 24): usmipc.torch after 08a9122 (templates only
# for a bundle opened before) beside 75be2f4 (the last build before
# templates), alternating B A B A on one machine; then at HEAD the Qwen
# kept handoffs, the update (bench_weights --update), the MoE pool, fan-out
# and fresh native exports.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu-run67.log") 2>&1
t0=$SECONDS
nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader
root=$PWD
i=0
for v in B A B A; do
  i=$((i+1))
  dir=$root; [ $v = A ] || dir=$root/.carry/ab/$v
  (cd "$dir" && python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1) || echo "PIP FAILED $v"
  echo "== $v installed at $((SECONDS-t0)) s"
  timeout 60 python3 tests/gpu/torch_mp_bench.py --rounds 15 --json "$OUT/tmb_${i}$v.json" > "$OUT/tmb_${i}$v.log" 2>&1; echo "rc $?"
  python3 - "$OUT/tmb_${i}$v.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for case in ("tensor_fresh", "tensor_repeated", "state_dict_cold", "state_dict_warm"):
    t, u = d["torch"][case], d["usmipc"][case]
    print(f"{case}: torch p+r {t['pickle_rebuild_ms']:.3f} (d {t['dumps_ms']:.3f} l {t['loads_ms']:.3f}) | usmipc p+r {u['pickle_rebuild_ms']:.3f} (d {u['dumps_ms']:.3f} l {u['loads_ms']:.3f}) | ratio {u['pickle_rebuild_ms'] / t['pickle_rebuild_ms']:.2f}, e2e {u['end_to_end_ms'] / t['end_to_end_ms']:.2f}")
PY
  echo "== $v done at $((SECONDS-t0)) s"
done
inst() { (cd "$1" && python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1) || echo "PIP FAILED $1"; }
for v in B A; do
  dir=$root; [ $v = A ] || dir=$root/.carry/ab/$v
  inst "$dir"
  timeout 60 python3 tests/gpu/export_bench.py --k 500 --rounds 5 --json "$OUT/export_$v.json" > "$OUT/export_$v.log" 2>&1
  echo "export $v rc $?"; tail -8 "$OUT/export_$v.log"
  echo "== export $v done at $((SECONDS-t0)) s"
done
timeout 120 python3 -m pytest -q -rs tests/gpu/test_gpu_events.py tests/gpu/test_gpu_update.py 2>&1 | tail -5
echo "== pytest done at $((SECONDS-t0)) s"
timeout 100 python3 tests/gpu/torch_mp_profile.py --n 200 > "$OUT/tmp_profile.log" 2>&1
echo "profile rc $?"; grep -v "^ *[0-9]* *[0-9.]* *[0-9.]* *[0-9.]* *[0-9.]* " "$OUT/tmp_profile.log" | head -60
echo "== profile done at $((SECONDS-t0)) s"
(cd "$OUT" && tar czf tmb.tgz tmb_* export_* && rm -f tmb_* export_*)
