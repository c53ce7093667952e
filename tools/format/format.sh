#!/usr/bin/env bash
# make format / make format-check: clang-format 14 over the C files of src/,
# include/ and python/usmipc/_ext/ (not tests/, not bench/).
#
#   tools/format/format.sh fix     rewrite the files in place
#   tools/format/format.sh check   change nothing; fail, naming each file that
#                                  would change (with its count of changes and
#                                  a short diff)
#
# .clang-format is written for clang-format 14: other versions format the
# same style differently, so a tree formatted by one fails the other's check.
# Both modes therefore refuse any other version. The binary is $CLANG_FORMAT
# (default clang-format-14); when that default is not installed, plain
# clang-format is used if its --version says 14.
set -euo pipefail
cd "$(dirname "$0")/../.."

mode=${1:-}
if [ "$mode" != fix ] && [ "$mode" != check ]; then
  echo "usage: $0 fix|check" >&2
  exit 2
fi

WANT=14
DIRS=(src include python/usmipc/_ext)
DIFF_LINES=12 # of each file's diff shown by check

version_of() { # the major version clang-format --version names, or ?
  local v
  v=$("$1" --version 2>/dev/null | sed -n 's/.*clang-format version \([0-9][0-9]*\)\..*/\1/p' | head -1)
  echo "${v:-?}"
}

refuse() { # refuse FOUND-VERSION PATH
  echo "clang-format $WANT is needed (.clang-format is written for it);" \
    "found version $1 at $2; install clang-format-$WANT or set CLANG_FORMAT=" >&2
  exit 1
}

cf=${CLANG_FORMAT:-clang-format-$WANT}
path=$(command -v "$cf" || true)
if [ -z "$path" ] && [ "$cf" = "clang-format-$WANT" ]; then
  path=$(command -v clang-format || true)
  if [ -z "$path" ]; then
    echo "clang-format $WANT is needed (.clang-format is written for it);" \
      "found neither clang-format-$WANT nor clang-format on PATH; install" \
      "clang-format-$WANT or set CLANG_FORMAT=" >&2
    exit 1
  fi
elif [ -z "$path" ]; then
  echo "clang-format $WANT is needed (.clang-format is written for it);" \
    "CLANG_FORMAT=$cf is not found; install clang-format-$WANT or set" \
    "CLANG_FORMAT= to its path" >&2
  exit 1
fi
version=$(version_of "$path")
[ "$version" = "$WANT" ] || refuse "$version" "$path"

mapfile -t files < <(find "${DIRS[@]}" -type f \( -name '*.c' -o -name '*.h' \) | LC_ALL=C sort)

if [ "$mode" = fix ]; then
  "$path" -i --style=file "${files[@]}"
  echo "format: ${#files[@]} files formatted with $path (clang-format $version)"
  exit 0
fi

bad=() total=0
for f in "${files[@]}"; do
  # --dry-run warns once for each replacement it would make.
  n=$("$path" --style=file --dry-run "$f" 2>&1 | grep -c 'Wclang-format-violations' || true)
  if [ "$n" -gt 0 ]; then
    bad+=("$f: $n")
    total=$((total + n))
  fi
done
if [ ${#bad[@]} -eq 0 ]; then
  echo "format-check: ${#files[@]} files as clang-format $version writes them"
  exit 0
fi
echo "format-check: ${#bad[@]} of ${#files[@]} files would change" \
  "($total changes); make format rewrites them:"
printf '  %s\n' "${bad[@]}"
for entry in "${bad[@]}"; do
  f=${entry%: *}
  d=$("$path" --style=file "$f" | diff -U1 --label "$f" --label "$f (clang-format)" "$f" - || true)
  lines=$(printf '%s\n' "$d" | wc -l)
  printf '%s\n' "$d" | head -n "$DIFF_LINES"
  if [ "$lines" -gt "$DIFF_LINES" ]; then
    echo "  ... $((lines - DIFF_LINES)) more lines of diff in $f"
  fi
done
echo "format-check: FAILED: ${#bad[@]} files, $total changes"
exit 1
