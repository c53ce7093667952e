#!/usr/bin/env python3
"""Two builds of usmipc side by side on the host benchmarks of `make bench`:
the first open, the cached re-open and the broker, run alternately (A B B A
...) so that both see the same machine, with the median over rounds of each
run's medians and the ratio B / A.

Used to show that a change which should not move performance (issue 22's
moves) did not: `python3 bench/pair_builds.py --a BASE_BUILD --b BUILD`
where each is a build directory with bench/usmipc_bench,
bench/usmipc_bench_first and bench/usmipc_bench_broker. Writes a Markdown
table to stdout and every run's JSON to --out.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run(build, tool, args, out):
    cmd = [os.path.join(build, "bench", tool), "--json", out] + args
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def figures(tool, d):
    """{name: microseconds} of one run."""
    got = {}
    if tool == "usmipc_bench":
        for r in d["results"]:
            size = r["size"]
            for key in ("export_first", "export_repeat", "open_first_socket",
                        "open_first_pidfd", "reopen_cached", "close_ref",
                        "close_last"):
                if key in r:
                    got[f"usmipc_bench {key} {size >> 10} KiB"] = \
                        r[key]["median"]
    elif tool == "usmipc_bench_first":
        for phase in ("cold", "warm"):
            got[f"first open {phase} (socket, 1 MiB)"] = statistics.median(
                d[phase]["usmipc_us"])
    elif tool == "usmipc_bench_broker":
        for t, v in d["transports"].items():
            for k, s in v.items():
                if isinstance(s, dict) and "median_us" in s:
                    got[f"broker {t} warm open, {s['importers']} importer(s)"] \
                        = s["median_us"]
    return got


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="the first build (before)")
    ap.add_argument("--b", required=True, help="the second build (after)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="pair-"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tools = {"usmipc_bench": ["--sizes", "4K,1M"],
             "usmipc_bench_first": [],
             "usmipc_bench_broker": ["--rounds", "3"]}
    samples = {"a": {}, "b": {}}
    for i in range(a.rounds):
        order = ("a", "b") if i % 2 == 0 else ("b", "a")
        for tool, args in tools.items():
            for which in order:
                build = a.a if which == "a" else a.b
                out = os.path.join(a.out, f"{tool}-{which}-{i}.json")
                for name, v in figures(tool, run(build, tool, args,
                                                 out)).items():
                    samples[which].setdefault(name, []).append(v)
        print(f"round {i + 1}/{a.rounds} done", file=sys.stderr)
    print(f"| figure (us) | A: {a.a} | B: {a.b} | B / A |")
    print("|---|---|---|---|")
    for name in samples["a"]:
        ma = statistics.median(samples["a"][name])
        mb = statistics.median(samples["b"][name])
        print(f"| {name} | {ma:.2f} | {mb:.2f} | {mb / ma:.3f} |")
    print(f"\nmedian over {a.rounds} alternated rounds of each run's median; "
          f"JSON in {a.out}")


if __name__ == "__main__":
    main()
