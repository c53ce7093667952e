#!/usr/bin/env bash
# Installs one release wheel (make wheel) into a fresh virtual environment
# of every CPython >= 3.11 on this machine and runs tests/python there
# against the installed package, never the source tree: pytest runs from an
# empty directory with PYTHONPATH unset, and USMIPC_TEST_INSTALLED=1 makes
# conftest.py stop if usmipc came from anywhere but the environment's
# site-packages. The tests' own files (examples/, README.md, the Level Zero
# test driver in build/) still come from the tree; `make build` first, or
# the Level Zero tests skip.
#
#   bash tests/install/wheel.sh [WHEEL]          (default: the one in dist/)
#
# PYTHONS="python3.11 /opt/py/bin/python3" names the interpreters (default:
# python3 and python3.N on PATH, and every version under pyenv's root).
# WHEEL_TEST_SUBSET="tests/python/test_a.py tests/python/test_b.py::name"
# runs those on every Python but the first (the first runs all of them). WHEEL_VENVS is where the
# environments go (default: build-wheel/venvs), each made anew.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"

wheel=${1:-}
if [ -z "$wheel" ]; then
  shopt -s nullglob
  wheels=(dist/usmipc-*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -ne 1 ]; then
    echo "wheel.sh: expected one wheel in dist/, found ${#wheels[@]} (make wheel)" >&2
    exit 2
  fi
  wheel=${wheels[0]}
fi
wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")
[ -f "$wheel" ] || { echo "wheel.sh: no such wheel: $wheel" >&2; exit 2; }
venvs=${WHEEL_VENVS:-$root/build-wheel/venvs}

# Interpreters: each CPython >= 3.11 once, by version, oldest first. A pyenv
# shim for a version pyenv has not selected fails to run, and is passed over.
candidates=()
if [ -n "${PYTHONS:-}" ]; then
  read -r -a candidates <<< "$PYTHONS"
else
  for n in $(seq 11 20); do
    command -v "python3.$n" > /dev/null && candidates+=("python3.$n")
  done
  candidates+=(python3)
  pyenv_root=${PYENV_ROOT:-$(pyenv root 2> /dev/null || echo "${HOME:-/root}/.pyenv")}
  for p in "$pyenv_root"/versions/*/bin/python3; do
    [ -x "$p" ] && candidates+=("$p")
  done
fi
declare -A seen=()
pythons=()
while read -r version python; do
  [ -n "$version" ] || continue
  [ -z "${seen[$version]:-}" ] || continue
  seen[$version]=1
  pythons+=("$python")
done < <(for c in "${candidates[@]}"; do
           v=$("$c" -c 'import sys, platform
if platform.python_implementation() == "CPython" and sys.version_info >= (3, 11):
    print("%d.%02d" % sys.version_info[:2])' 2> /dev/null) && [ -n "$v" ] && echo "$v $c"
         done | sort -s -k1,1)
if [ ${#pythons[@]} -eq 0 ]; then
  echo "wheel.sh: no CPython >= 3.11 found (set PYTHONS)" >&2
  exit 2
fi

echo "wheel: $(basename "$wheel")"
echo "interpreters: ${pythons[*]}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$venvs"
venvs=$(cd "$venvs" && pwd)
first=1
for python in "${pythons[@]}"; do
  t0=$SECONDS
  version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  venv=$venvs/$version
  rm -rf "$venv"
  "$python" -m venv "$venv"
  # The test dependencies (Makefile's venv target; UMF is for the C tests).
  "$venv/bin/python" -m pip install -q pytest numpy mypy
  "$venv/bin/python" -m pip install -q --no-index --no-deps "$wheel"
  (cd "$work" && env -u PYTHONPATH "$venv/bin/python" -c 'import importlib.metadata as m, usmipc
tags = [l.split(": ")[1] for l in m.distribution("usmipc").read_text("WHEEL").splitlines() if l.startswith("Tag: ")]
print("usmipc", usmipc.__version__, "from", usmipc.__path__[0], "wheel tags", " ".join(tags))')
  echo "== Python $version ($python): installed in $((SECONDS - t0)) s"
  selection=(tests/python)
  if [ $first -eq 0 ] && [ -n "${WHEEL_TEST_SUBSET:-}" ]; then
    read -r -a selection <<< "$WHEEL_TEST_SUBSET"
  fi
  # From an empty directory: neither the tree nor python/ is on sys.path.
  (cd "$work" && env -u PYTHONPATH PYTHONNOUSERSITE=1 USMIPC_TEST_INSTALLED=1 \
     "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider \
     --rootdir "$root" -c "$root/pyproject.toml" \
     "${selection[@]/#tests/$root/tests}")
  echo "== Python $version: done in $((SECONDS - t0)) s"
  first=0
done
