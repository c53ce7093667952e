#!/usr/bin/env bash
# Third issue-11 GPU run: the to='torch' and expandable-segment bundle tests
# and the allocator's stream rule, each with its own time limit.
set -u
OUT=${OUT:-/tmp/usmipc-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/issue11c.log"; : > "$LOG"
{ python3 -m pip install -q --no-build-isolation --no-index --no-deps . && echo pip ok
  for t in tests/gpu/test_bundles_to_torch.py tests/gpu/test_bundles_expandable.py "tests/gpu/test_torch_allocator.py -k stream"; do
    echo "=== $t"; timeout 140 python3 -m pytest -x -q -rs -s --tb=short $t 2>&1 | tail -80
  done
} >> "$LOG" 2>&1
cat "$LOG"
