#!/usr/bin/env python3
"""Compares the layout of a benchmark's JSON with a reference kept in
bench/results/: the same keys at every level (values are not compared).
tests/gpu/run.sh bench-layout runs it on every benchmark's JSON.

    python3 tests/gpu/bench_layout.py REFERENCE.json NEW.json [--no-errors]

Lists are compared by their first element; maps of sizes ("sizes") by the
sizes both have. Machine and library details (meta, a system's info) are
skipped. With --no-errors, any key named error or ending in _error in NEW is
a failure too, and so is a system whose status is not "ok". Exit status 0
when the layouts agree, 1 otherwise (each difference on a line).
"""
import json
import sys

SKIPPED = {"meta", "info", "report_markdown", "traceback"}


def compare(ref, new, path, out):
    if isinstance(ref, dict) and isinstance(new, dict):
        keys_ref, keys_new = set(ref), set(new)
        if path.endswith("/sizes"):
            keys_ref = keys_new = keys_ref & keys_new
        for k in sorted(keys_ref - keys_new):
            out.append(f"{path}/{k}: missing")
        for k in sorted(keys_new - keys_ref):
            out.append(f"{path}/{k}: not in the reference")
        for k in sorted(keys_ref & keys_new):
            if k not in SKIPPED:
                compare(ref[k], new[k], f"{path}/{k}", out)
    elif isinstance(ref, list) and isinstance(new, list):
        if ref and new:
            compare(ref[0], new[0], f"{path}[0]", out)
    elif ref is not None and new is not None and isinstance(ref, dict) != isinstance(new, dict):
        out.append(f"{path}: {type(ref).__name__} in the reference, {type(new).__name__} now")


def errors(new, path, out):
    if isinstance(new, dict):
        for k, v in new.items():
            if k == "error" or k.endswith("_error"):
                out.append(f"{path}/{k}: {str(v)[:200]}")
            elif k == "status" and v != "ok" and isinstance(v, str):
                out.append(f"{path}/status: {v[:200]}")
            elif k not in SKIPPED:
                errors(v, f"{path}/{k}", out)
    elif isinstance(new, list):
        for i, v in enumerate(new):
            errors(v, f"{path}[{i}]", out)


def main(argv):
    if len(argv) not in (3, 4) or (len(argv) == 4 and argv[3] != "--no-errors"):
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        ref = json.load(f)
    with open(argv[2]) as f:
        new = json.load(f)
    out = []
    compare(ref, new, "", out)
    if len(argv) == 4:
        errors(new, "", out)
    for line in out:
        print(f"{argv[2]}: {line}")
    print(f"{argv[2]}: {'layout as ' + argv[1] if not out else f'{len(out)} differences'}")
    return 1 if out else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
