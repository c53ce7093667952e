#!/usr/bin/env bash
# PyTorch's own test/test_multiprocessing.py with usmipc.torch installed in
# every process (USMIPC_TORCH=1: the .pth switch, as a launcher would set
# it), then a check that every CUDA tensor any process pickled went through
# usmipc (tests/torch_mp/check_stats.py over each process's counters).
#
# The test file is PyTorch's code: it is not in this tree. Put it (and an
# expecttest wheel, which torch.testing._internal needs) in the ignored
# folder .carry/torch_mp/ and carry that folder to the GPU machine:
#   .carry/torch_mp/test_multiprocessing.py   the file, from pytorch/pytorch
#   .carry/torch_mp/SOURCE.txt                which commit it is
#   .carry/wheels/expecttest-*.whl
#
#   PY=python3 OUT=dir bash tests/torch_mp/run.sh [unittest arguments]
#
# PYTORCH_TEST_WITH_SLOW=1 runs the slow tests too (test_cuda_send_many).
# Writes OUT/unittest.log, OUT/tests.txt (a verdict per test),
# OUT/stats/<pid>.json, OUT/stats.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
FILE=${TORCH_MP_FILE:-.carry/torch_mp/test_multiprocessing.py}
OUT=${OUT:-/tmp/usmipc-torch-mp}
mkdir -p "$OUT"
if [ ! -f "$FILE" ]; then
  echo "run.sh: $FILE is missing: fetch pytorch/pytorch's test/test_multiprocessing.py for the installed torch into it" >&2
  exit 2
fi
$PY -c 'import expecttest' 2>/dev/null ||
  $PY -m pip install -q --no-index --find-links .carry/wheels expecttest
rm -rf "$OUT/stats"
mkdir -p "$OUT/stats"
{
  echo "== $(date -u +%F' '%T) UTC on $(hostname)"
  $PY -c 'import torch, usmipc; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count(), "usmipc", usmipc.__version__)'
  echo "== test file: $(cat "$(dirname "$FILE")/SOURCE.txt" 2>/dev/null || echo "$FILE")"
  echo "== USMIPC_TORCH=1 PYTORCH_TEST_WITH_SLOW=${PYTORCH_TEST_WITH_SLOW-1} $PY $FILE -v $*"
} | tee "$OUT/unittest.log"
# One process per test, each under PER_TEST seconds (default 150): a test
# that hangs costs its own limit, and every other test still runs and
# prints its traceback (run 47 lost test_cuda_send_many's to a later hang).
# A test that runs out of time gets SIGABRT, sent by timeout to its whole
# process group, so that every Python process of it (spawned children
# included) prints where each of its threads stood (PYTHONFAULTHANDLER).
# Test names as arguments run only those.
if [ $# -eq 0 ]; then
  mapfile -t tests < <($PY - "$FILE" <<'PY'
import importlib.util, sys, unittest
spec = importlib.util.spec_from_file_location("torch_mp_file", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
loader = unittest.TestLoader()
for name in sorted(vars(mod)):
    cls = getattr(mod, name)
    if isinstance(cls, type) and issubclass(cls, unittest.TestCase):
        for t in loader.getTestCaseNames(cls):
            print(f"{name}.{t}")
PY
  )
  set -- "${tests[@]}"
fi
echo "== $# tests, each in its own process, ${PER_TEST:-150} s each at most" | tee -a "$OUT/unittest.log"
rc=0
: > "$OUT/tests.txt"
for t in "$@"; do
  USMIPC_TORCH=1 USMIPC_TORCH_STATS="$OUT/stats" \
    PYTORCH_TEST_WITH_SLOW=${PYTORCH_TEST_WITH_SLOW-1} \
    PYTHONFAULTHANDLER=1 timeout -s ABRT -k 10 "${PER_TEST:-150}" \
    $PY "$FILE" -v "$t" >> "$OUT/unittest.log" 2>&1
  r=$?
  case $r in
    0) verdict=ok ;;
    124 | 137) verdict="TIMEOUT (${PER_TEST:-150} s)"; rc=1 ;;
    *) verdict="FAIL ($r)"; rc=1 ;;
  esac
  echo "$t: $verdict" | tee -a "$OUT/tests.txt"
done
grep -c ": ok$" "$OUT/tests.txt" | sed 's/$/ passed (skips included: see unittest.log)/'
$PY tests/torch_mp/check_stats.py "$OUT/stats" | tee "$OUT/stats.txt"
src=${PIPESTATUS[0]}
echo "== unittest exit $rc, stats check exit $src" | tee -a "$OUT/unittest.log"
[ "$rc" -eq 0 ] && [ "$src" -eq 0 ]
