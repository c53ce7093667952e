#!/usr/bin/env python3
"""The behaviour probe (tools/probe/README.md): runs the C suite (ctest,
Level Zero suites included) and the Python suite with USMIPC_TEST_PROBE set,
so that every failure the tests check is recorded with its code and message;
normalises what varies from run to run (pids, addresses, descriptors, paths,
timings); writes the records sorted and de-duplicated.

    python3 tools/probe/run.py                      # -> build/probe.txt
    python3 tools/probe/run.py --compare tools/probe/expected.txt
    python3 tools/probe/run.py --raw RAW --no-run   # normalise a raw file only

With --compare the exit status is 1 and the diff is printed when the records
differ from FILE (records listed in tools/probe/unstable.txt are left out on
both sides); 2 when a suite failed (the records of its failed tests may then
be incomplete: run.py names them).
"""

import argparse
import difflib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
UNSTABLE = os.path.join(HERE, "unstable.txt")

# ---- normalisation -----------------------------------------------------------
# Each rule replaces what differs between two runs of the same code by a
# placeholder. Order matters: paths before numbers, long hex before short.
# The rules are kept narrow, so that a changed constant in a message (a size,
# a record type, a field name) still shows in the diff.


def _rules(root):
    r = []
    add = lambda pat, rep, flags=0: r.append((re.compile(pat, flags), rep))
    # The checkout itself (another worktree gives the same records).
    add(re.escape(root), "<root>")
    # pytest's temporary directories and the suites' own under /tmp.
    add(r"/tmp/pytest-of-[^/\s]+/pytest-\d+/[^\s'\":,)]*", "<tmp>")
    add(r"/tmp/[A-Za-z0-9_.-]*?(?:usmipc|tmp|probe)[A-Za-z0-9_.-]*"
        r"(?:/[^\s'\":,)]*)?", "<tmp>")
    # /proc/<pid>/...
    add(r"/proc/\d+/", "/proc/<pid>/")
    # The broker's socket names: usmipc.<pid>.<random>.
    add(r"usmipc\.\d+\.[0-9a-zA-Z]+", "usmipc.<pid>.<name>")
    # Addresses and tokens: 9 hex digits or more (shorter ones are constants:
    # record types, flags, driver versions, 0x78000001).
    add(r"0x[0-9a-fA-F]{9,}", "<hex>")
    # Device UUIDs (the host's is derived from the machine).
    add(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b",
        "<uuid>")
    # Buffer ids (random 64-bit numbers).
    add(r"\b(buffer |buffer_id |buffer id )\d{6,}", r"\1<id>")
    # Process ids in words.
    add(r"\b(pids? |process |exporter |importer |peer |agent |\[pid |"
        r"PID |pid=|pid: )\d+", r"\1<pid>", re.IGNORECASE)
    # Descriptor numbers: they depend on what else the process has open.
    # Numbers of 4 digits or more are the tests' own constants (a closed
    # descriptor 1000000, a driver's 2147418113) and stay.
    add(r"\b(fd |descriptor |fd=|fd: |fd#)\d{1,3}\b", r"\1<fd>")
    add(r"/proc/(self|<pid>)/fd/\d+", r"/proc/\1/fd/<fd>")
    # Times measured: the agent's timed open ("refused [after 1234 us]").
    # Configured ones ("timed out after 300 ms") are kept: they are the
    # test's own settings, and the same in every run.
    add(r"\[after \d+ us\]", "[after <n> us]")
    return r


def normalise_field(text, rules):
    for pat, rep in rules:
        text = pat.sub(rep, text)
    return text


def normalise(raw_lines, root):
    """Raw records -> the set of normalised records, and the count of raw
    records read."""
    rules = _rules(root)
    out = set()
    n = 0
    seen = {}  # fields repeat: each distinct one is normalised once

    def norm(text):
        got = seen.get(text)
        if got is None:
            got = seen[text] = normalise_field(text, rules)
        return got

    for line in raw_lines:
        line = line.rstrip("\n")
        if not line:
            continue
        f = line.split("\t")
        if len(f) != 8:  # a torn or foreign line: kept, visibly
            out.add("?\t" + normalise_field(line, rules))
            continue
        n += 1
        suite, _pid, context, test, _where, what, code, message = f
        fields = [suite, context, test, what, code, message]
        out.add("\t".join(norm(x) for x in fields))
    return out, n


# ---- known-unstable records -----------------------------------------------------


def read_unstable(path):
    """The records of unstable.txt (its lines other than comments and blank
    lines), compared exactly."""
    if not os.path.exists(path):
        return set()
    keep = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if line and not line.startswith("#"):
                keep.add(line)
    return keep


# ---- running the suites -----------------------------------------------------


def run(cmd, env, log, timeout=None):
    """Runs cmd in its own process group, output to log; a run past timeout
    seconds is killed, group and all (a hung test), and counts as failed."""
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "killed: past its limit of %d s" % timeout
    print(f"  exit {rc} after {time.monotonic() - t0:.0f} s (log: {log})",
          file=sys.stderr, flush=True)
    return rc


def run_suites(raw, args):
    env = dict(os.environ)
    env.pop("USMIPC_TEST_PROBE", None)
    log = os.path.join(args.build, "probe.log")
    os.makedirs(os.path.join(ROOT, args.build), exist_ok=True)
    log = os.path.join(ROOT, log)
    open(log, "w").close()
    failed = []
    if not args.no_build:
        for target in ("build", "python"):
            if run(["make", target, f"JOBS={args.jobs}", f"BUILD={args.build}"],
                   env, log):
                sys.exit(f"make {target} failed (see {log})")
    env["USMIPC_TEST_PROBE"] = raw
    start = os.path.getsize(log)
    if run(["ctest", "--test-dir", args.build, f"-j{args.jobs}",
            "--output-on-failure"], env, log, args.timeout):
        # Name the tests: a failed test stops at its first failed check, so
        # the records of its later checks are missing from this run.
        with open(log, errors="replace") as f:
            f.seek(start)
            tail = f.read().split("The following tests FAILED:")[-1]
        names = re.findall(r"^\s*\d+ - (\S+)", tail, re.MULTILINE)
        failed.append("ctest (" + (", ".join(names) or "see the log") + ")")
    py = os.path.join(ROOT, ".venv", "bin", "python")
    env["USMIPC_BUILD_DIR"] = args.build
    if run([py if os.path.exists(py) else sys.executable, "-m", "pytest",
            "-q", "-p", "no:cacheprovider", "-rf", "tests/python"], env, log,
           args.timeout):
        failed.append("pytest (its FAILED lines are at the end of the log)")
    return failed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None,
                    help="where the normalised records go "
                         "(default: BUILD/probe.txt)")
    ap.add_argument("--compare", metavar="FILE",
                    help="diff the records against FILE; exit 1 if they differ")
    ap.add_argument("--raw", help="keep the raw records here (with --no-run: "
                                  "normalise this file)")
    ap.add_argument("--no-run", action="store_true",
                    help="run no suite: normalise --raw")
    ap.add_argument("--no-build", action="store_true",
                    help="skip make build and make python")
    ap.add_argument("--build", default="build", help="the build directory")
    ap.add_argument("--jobs", default="2", help="make's and ctest's -j")
    ap.add_argument("--timeout", type=int, default=1500,
                    help="seconds each suite may run before it is killed "
                         "(a hung test)")
    ap.add_argument("--unstable", default=UNSTABLE,
                    help="records the comparison ignores")
    args = ap.parse_args()

    t0 = time.monotonic()
    failed = []
    if args.no_run:
        if not args.raw:
            ap.error("--no-run needs --raw")
        raw = args.raw
    else:
        raw = args.raw or tempfile.NamedTemporaryFile(
            prefix="usmipc-probe-raw-", suffix=".txt", delete=False).name
        open(raw, "w").close()
        failed = run_suites(os.path.abspath(raw), args)
    with open(raw, encoding="utf-8", errors="backslashreplace") as f:
        records, n = normalise(f, ROOT)
    if not args.raw:
        os.unlink(raw)
    out = args.out or os.path.join(ROOT, args.build, "probe.txt")
    lines = sorted(records)
    with open(out, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)
    unstable = read_unstable(args.unstable)
    print(f"{n} raw records, {len(lines)} distinct after normalisation "
          f"({len(unstable & records)} of them listed as unstable), "
          f"in {time.monotonic() - t0:.0f} s: {out}", file=sys.stderr)
    if failed:
        print(f"FAILED: {'; '.join(failed)}: the records of those tests may "
              "be incomplete", file=sys.stderr)
    if args.compare:
        with open(args.compare, encoding="utf-8") as f:
            expected = [line.rstrip("\n") for line in f if line.strip()]
        a = [x for x in expected if x not in unstable]
        b = [x for x in lines if x not in unstable]
        diff = list(difflib.unified_diff(a, b, args.compare, out, lineterm="",
                                         n=0))
        if diff:
            print("\n".join(diff))
            print(f"probe: {sum(1 for d in diff if d[:1] == '-' and d[:3] != '---')}"
                  f" records gone, "
                  f"{sum(1 for d in diff if d[:1] == '+' and d[:3] != '+++')}"
                  " records new", file=sys.stderr)
            return 1
        print("probe: no difference", file=sys.stderr)
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
