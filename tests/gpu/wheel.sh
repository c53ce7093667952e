#!/usr/bin/env bash
# The release wheel on the device machine: installs the one wheel in dist/
# (built here by `make wheel`; the device machine has no network and no
# ziglang, so the wheel travels with the tree) into a fresh virtual
# environment of python3.12 that sees the system's packages (pytest, numpy,
# torch, CuPy), and runs the Python suites against it: tests/python (the
# host suite), tests/gpu (CUDA, torch, CuPy) and the demo on the GPU.
# Every step runs even if an earlier one failed; logs go to $OUT.
#
#   OUT=/tmp/out bash tests/gpu/wheel.sh          (with dist/ carried along)
#
# WHEEL_SKIP_GPU=1 leaves out tests/gpu and the torch allocator's suite.
# PYTHON names the interpreter (default python3.12, else python3). The Level
# Zero tests of tests/python use the test driver in build/: the script
# builds it with CMake first where CMake is installed (NO_BUILD=1 skips).
set -u
cd "$(dirname "$0")/../.."
root=$PWD
OUT=${OUT:-/tmp/usmipc-gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
status=0
: > "$OUT/wheel-summary.txt"
: > "$OUT/wheel.log"
step() { # step NAME COMMAND...: runs in an empty directory, logs, records
  local name=$1 t0=$SECONDS r
  shift
  echo "=== $name: $*"
  if (cd "$work" && env -u PYTHONPATH "$@") > "$work/$name.log" 2>&1; then
    r=pass
  else
    r="FAIL($?)"
    status=1
  fi
  { echo "=== $name: $*"; cat "$work/$name.log"; echo "=== $name: $r"; } >> "$OUT/wheel.log"
  tail -n 15 "$work/$name.log"
  echo "=== $name: $r in $((SECONDS - t0))s"
  echo "$name $r $((SECONDS - t0))s" >> "$OUT/wheel-summary.txt"
}

shopt -s nullglob
wheels=(dist/usmipc-*.whl)
shopt -u nullglob
if [ ${#wheels[@]} -ne 1 ]; then
  echo "expected one wheel in dist/, found ${#wheels[@]}: run make wheel here and carry dist/" >&2
  exit 2
fi
wheel=$root/${wheels[0]}
python=${PYTHON:-$(command -v python3.12 || command -v python3)}
work=$(mktemp -d)
venv=$work/venv
trap 'rm -rf "$work"' EXIT
echo "wheel: $(basename "$wheel")"
"$python" -c 'import sys; print(sys.version)'
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader 2>/dev/null

# Without ensurepip (Debian's python3-venv), a venv without pip, into which
# the system's pip installs (pip >= 22.3: --python).
pip=("$venv/bin/python" -m pip)
if ! "$python" -m venv --system-site-packages "$venv" > "$work/venv.log" 2>&1; then
  cat "$work/venv.log"
  rm -rf "$venv"
  pip=("$python" -m pip --python "$venv/bin/python")
  step venv "$python" -m venv --system-site-packages --without-pip "$venv"
fi
# Where the system lacks them and there is a network: WHEEL_TEST_DEPS="pytest numpy".
if [ -n "${WHEEL_TEST_DEPS:-}" ]; then
  step deps "${pip[@]}" install -q $WHEEL_TEST_DEPS
fi
# An interpreter that is itself a virtual environment (the device image's
# python3 is /opt/torch/.venv): --system-site-packages shows the base
# interpreter's packages, not that environment's (pytest, torch, CuPy), so
# a .pth file adds its site-packages behind the new environment's own.
"$python" - "$venv" <<'PY'
import pathlib, site, sys, sysconfig
if sys.prefix != sys.base_prefix:
    venv = pathlib.Path(sys.argv[1])
    ver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    target = venv / "lib" / ver / "site-packages" / "_outer_env.pth"
    target.write_text("\n".join(site.getsitepackages()) + "\n")
    print("outer environment's packages:", target.read_text().strip())
PY
# --ignore-installed: the outer environment may hold a usmipc of its own,
# which pip would otherwise call satisfied (and install nothing here).
step install "${pip[@]}" install --no-index --no-deps --ignore-installed "$wheel"
# Where usmipc comes from, and which wheel: the environment's site-packages.
step where "$venv/bin/python" -c 'import importlib.metadata as m, sys, sysconfig, usmipc
d = m.distribution("usmipc")
print("usmipc", usmipc.__version__, "from", usmipc.__path__[0])
print([l for l in d.read_text("WHEEL").splitlines() if l.startswith("Tag")])
assert usmipc.__path__[0].startswith(sysconfig.get_paths()["platlib"]), sys.path'
step list "$venv/bin/python" -m usmipc
if [ "${NO_BUILD:-0}" != 1 ] && command -v cmake > /dev/null; then
  step build-driver bash -c "cmake -S '$root' -B '$root/build' > /dev/null && cmake --build '$root/build' -j 16 > /dev/null"
fi
step demo-cuda "$venv/bin/python" -m usmipc demo --device cuda:gpu
step pytest-host env USMIPC_TEST_INSTALLED=1 "$venv/bin/python" -m pytest -q -rs \
  -p no:cacheprovider --rootdir "$root" -c "$root/pyproject.toml" "$root/tests/python"
# WHEEL_SKIP_GPU=1: the GPU suites ran already against a source install.
if [ "${WHEEL_SKIP_GPU:-0}" != 1 ]; then
  step pytest-gpu "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider \
    --rootdir "$root" -c "$root/pyproject.toml" "$root/tests/gpu" \
    --ignore="$root/tests/gpu/test_gpu_torch_allocator.py"
  step torch-allocator "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider \
    --rootdir "$root" -c "$root/pyproject.toml" "$root/tests/gpu/test_gpu_torch_allocator.py"
fi
echo "=== summary"
cat "$OUT/wheel-summary.txt"
exit $status
