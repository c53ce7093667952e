# What the GPU runner tests/gpu/run.sh uses (sourced, not run): the
# environment the device notes ask for, a log that starts with the
# machine's versions, `build` and `install`, and `step NAME SECONDS
# COMMAND...`, which runs COMMAND (a program or a function of the sourcing
# script) under a time limit, appends its output to $LOG, prints its last
# lines, appends a line "NAME pass|FAIL(rc) Ns" to $SUM, sets status=1 when
# it failed, and never stops the run.
#
#   . tests/gpu/steps.sh NAME    logs to $OUT/NAME.log, $OUT/summary-NAME.txt
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/usmipc-gpu}; mkdir -p "$OUT"
# Never NVLink multicast on the shared machines (device README).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
LOG="$OUT/$1.log"; SUM="$OUT/summary-$1.txt"; : > "$LOG"; : > "$SUM"
status=0
step() { # step NAME SECONDS COMMAND...
  local name=$1 limit=$2 r t0=$SECONDS out
  shift 2
  out=$(mktemp)
  echo "=== $name: $*"
  # The command may be a function of the script: run it in a bash that has
  # every function defined so far.
  if timeout "$limit" bash -c "$(declare -f); \"\$@\"" step "$@" > "$out" 2>&1
  then r=pass; else r="FAIL($?)"; status=1; fi
  { echo "=== $name: $*"; cat "$out"; } >> "$LOG"
  tail -n 15 "$out"
  rm -f "$out"
  echo "$name $r $((SECONDS - t0))s" | tee -a "$SUM" >> "$LOG"
  echo "=== $name: $r in $((SECONDS - t0))s"
}
summary() {
  echo "=== summary" | tee -a "$LOG"; tee -a "$LOG" < "$SUM"
}
{ date -u
  nvidia-smi --query-gpu=index,name,driver_version,uuid --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -5
  uname -r
  python3 -c 'import sys; print("python", sys.version.split()[0])'
  for m in torch cupy; do
    python3 -c "import $m; print('$m', $m.__version__)" 2>/dev/null || echo "$m: not installed"
  done
} 2>&1 | tee -a "$LOG"

build() {
  set -o pipefail # a failed build fails the step, whatever grep finds
  cmake -S . -B build-gpu -DUSMIPC_WERROR=ON > /dev/null &&
    cmake --build build-gpu -j "$(nproc)" 2>&1 | grep -E "error|warning|Built target usmipc_tests"
}
# scikit-build-core older than 0.11 refuses the SPDX license field (PEP
# 639): then the install is retried with the older form, and the log says so.
install() {
  python3 -m pip install -q --no-build-isolation --no-index --no-deps . && return 0
  echo "pip install failed: retrying with license = { text = ... } (old scikit-build-core)"
  sed -i 's/^license = "Apache-2.0"/license = { text = "Apache-2.0" }/; /^license-files/d' pyproject.toml
  python3 -m pip install -q --no-build-isolation --no-index --no-deps .
}
