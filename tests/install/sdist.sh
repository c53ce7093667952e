#!/usr/bin/env bash
# Checks a source distribution (make sdist): it holds what a build needs,
# and pip builds and installs a wheel from it alone (build isolation, so
# scikit-build-core comes from the package index, as for a user's `pip
# install usmipc` without a wheel) in a fresh virtual environment, outside
# the tree; the installed package then imports, carries its helper, and runs
# the demo across two processes on the host.
#
#   bash tests/install/sdist.sh dist/usmipc-X.Y.Z.tar.gz
#
# PYTHON names the interpreter (default python3).
set -euo pipefail
[ $# -eq 1 ] && [ -f "$1" ] || { echo "usage: $0 SDIST.tar.gz" >&2; exit 2; }
sdist=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

top=$(basename "$sdist" .tar.gz)
tar -tzf "$sdist" | sed "s|^$top/||" > "$work/contents"
missing=0
for f in LICENSE README.md CHANGELOG.md pyproject.toml CMakeLists.txt \
         cmake/usmipc.pc.in cmake/usmipcConfig.cmake.in include/usmipc.h \
         include/usmipc/errno.h src/wire/handle.c src/backend/backend.h \
         src/linux/broker.c src/tools/usmipc_helper.c python/CMakeLists.txt \
         python/usmipc/__init__.py python/usmipc/_usmipc.pyi \
         python/usmipc/py.typed python/usmipc/_ext/module.c PKG-INFO; do
  grep -qx "$f" "$work/contents" || { echo "sdist lacks $f" >&2; missing=1; }
done
# Nothing built or private: no environments, build trees, wheels or objects.
if grep -E '^(\.venv|build[^/]*|dist|\.git)/|\.(so|o|whl)$' "$work/contents"; then
  echo "sdist carries build outputs (above)" >&2
  missing=1
fi
[ $missing -eq 0 ]
echo "sdist: $(wc -l < "$work/contents") files, $(du -k "$sdist" | cut -f1) KiB"

t0=$SECONDS
"$python" -m venv "$work/venv"
# --no-cache-dir: an identical sdist (they are reproducible) would otherwise
# install the wheel pip built from it last time.
(cd "$work" && env -u PYTHONPATH venv/bin/python -m pip install -q --no-cache-dir "$sdist")
echo "built and installed from the sdist in $((SECONDS - t0)) s"
cd "$work"
env -u PYTHONPATH venv/bin/python - << 'EOF'
import os, sys, usmipc
package = os.path.dirname(usmipc.__file__)
assert package.startswith(sys.prefix), package
assert os.access(os.path.join(package, "usmipc-helper"), os.X_OK)
for name in ("py.typed", "_usmipc.pyi"):
    assert os.path.exists(os.path.join(package, name)), name
print("usmipc", usmipc.__version__, "from", package)
EOF
env -u PYTHONPATH venv/bin/python -m usmipc demo --device host:cpu
