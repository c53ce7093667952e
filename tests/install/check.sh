#!/usr/bin/env bash
# Installs the build tree BUILD into a temporary prefix and builds a C
# consumer against it twice: with find_package(usmipc) and with pkg-config.
set -euo pipefail
build=$1
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" > /dev/null
libdir=$(dirname "$(find "$tmp/prefix" -name 'libusmipc.so' | head -n 1)")
cmake -S "$here" -B "$tmp/cmake" -DCMAKE_PREFIX_PATH="$tmp/prefix" > /dev/null
cmake --build "$tmp/cmake" > /dev/null
LD_LIBRARY_PATH=$libdir "$tmp/cmake/consumer"
if command -v pkg-config > /dev/null; then
  export PKG_CONFIG_PATH=$libdir/pkgconfig
  cc "$here/consumer.c" $(pkg-config --cflags --libs usmipc) -o "$tmp/pc"
  LD_LIBRARY_PATH=$libdir "$tmp/pc"
else
  echo "pkg-config not installed: .pc file not checked"
fi
