#!/usr/bin/env bash
# Second issue-11 GPU run: the fixes of the first (to='torch', the stream
# rule's test), the bundle tests and the weight handoff.
set -u
OUT=${OUT:-/tmp/usmipc-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
LOG="$OUT/issue11b.log"; : > "$LOG"
{ date -u
  python3 -m pip install -q --no-build-isolation --no-index --no-deps . && echo pip ok
  timeout 300 python3 -m pytest -q -rs -s tests/gpu/test_bundles_to_torch.py tests/gpu/test_bundles_expandable.py tests/gpu/test_bundles.py tests/gpu/test_torch_allocator.py 2>&1 | tail -60
  timeout 240 python3 bench/bench_weights.py --reps 5 --json "$OUT/bench_weights_h200.json" 2>&1 | grep -v Warning | tail -30
} >> "$LOG" 2>&1
cat "$LOG"
