"""Prints why each skipped C test skipped (make test-c runs it after ctest).

ctest lists skipped tests without their reasons; each test prints its
reason as a "SKIP: ..." line, which ctest keeps in
Testing/Temporary/LastTest.log. One line per reason, with the tests that
gave it, so that a reader sees what this machine did not check.

    python3 tools/test/ctest_skips.py BUILD_DIR
"""
import collections
import pathlib
import re
import sys


def main():
    log = pathlib.Path(sys.argv[1]) / "Testing" / "Temporary" / "LastTest.log"
    if not log.exists():
        return 0
    reasons = collections.OrderedDict()
    name = None
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"\d+/\d+ Test: (\S+)", line)
        if m:
            name = m.group(1)
        elif line.startswith("SKIP: ") and name:
            reasons.setdefault(line[6:].strip(), []).append(name)
            name = None
    if reasons:
        total = sum(len(v) for v in reasons.values())
        print(f"skipped C tests: {total}, for {len(reasons)} reasons")
        for reason, names in reasons.items():
            shown = ", ".join(names[:3]) + (
                f" and {len(names) - 3} more" if len(names) > 3 else "")
            print(f"  {reason}: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
