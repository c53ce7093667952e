# What the GPU scripts of one device call share (sourced, not run): the
# environment the device notes ask for, a log with the machine's versions,
# and `step NAME SECONDS COMMAND...`, which runs COMMAND (a program or a
# function of the sourcing script) under a time limit, appends its output to
# $LOG and a line "NAME pass|FAIL(rc) Ns" to $SUM, and never stops the run.
#
#   . tests/gpu/steps.sh NAME    logs to $OUT/NAME.log, summary-NAME.txt
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/usmipc-gpu}; mkdir -p "$OUT"
# Never NVLink multicast on the shared machines (device README).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
LOG="$OUT/$1.log"; SUM="$OUT/summary-$1.txt"; : > "$LOG"; : > "$SUM"
step() { # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "=== $name: $*" >> "$LOG"
  # The command may be a function of the script: run it in a bash that has
  # every function defined so far.
  if timeout "$limit" bash -c "$(declare -f); \"\$@\"" step "$@" >> "$LOG" 2>&1
  then r=pass; else r="FAIL($?)"; fi
  echo "$name $r $(( $(date +%s) - t0 ))s" | tee -a "$SUM" >> "$LOG"
}
summary() {
  echo "=== summary" >> "$LOG"; cat "$SUM" | tee -a "$LOG"
}
{ date -u; nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'
} >> "$LOG" 2>&1

build() {
  set -o pipefail # a failed build fails the step, whatever grep finds
  cmake -S . -B build-gpu -DUSMIPC_WERROR=ON > /dev/null &&
    cmake --build build-gpu -j 16 2>&1 | grep -E "error|warning|Built target usmipc_tests"
}
# scikit-build-core older than 0.11 refuses the SPDX license field (PEP
# 639): then the install is retried with the older form, and the log says so.
install() {
  python3 -m pip install -q --no-build-isolation --no-index --no-deps . && return 0
  echo "pip install failed: retrying with license = { text = ... } (old scikit-build-core)"
  sed -i 's/^license = "Apache-2.0"/license = { text = "Apache-2.0" }/; /^license-files/d' pyproject.toml
  python3 -m pip install -q --no-build-isolation --no-index --no-deps .
}
