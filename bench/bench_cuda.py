#!/usr/bin/env python3
"""CUDA IPC side by side: usmipc (fd and native) against CuPy, PyTorch and cuda.core.

Every system runs in its own producer process (started with subprocess, so
this driver never initialises CUDA); each producer starts its consumer with
multiprocessing's *spawn* context (never fork after CUDA init), allocates K
fresh buffers per size, exports them, and keeps them alive until the consumer
has reported. The consumer opens every handle once (a true first open), reads
the first imported buffer with device-to-device copies (CUDA events), times
re-opens of an already-open handle, and closes everything.

    python3 bench/bench_cuda.py [--sizes 4K,1M,256M,1G] [--k 40]
        [--systems usmipc-fd,usmipc-native,cupy,torch,cuda.core,staged]
        [--json out.json] [--plot out.png]
    python3 bench/bench_cuda.py --selftest    # no GPU needed

Prints Markdown tables (rows: systems, columns: sizes) of medians; --json
writes everything (p10/p90/min/first sample, notes, errors); --plot draws
export and first-open latency against size. A system that fails is reported
as "n/a: <error>" and the others still run.

This file is the command line; the machinery lives in cudabench/ (harness,
measurement, driver, report) and each system in cudabench/peers/, one module
each (bench/README.md).
"""
import argparse
import json
import sys

from cudabench.harness import DEFAULT_SIZES, errstr, log, parse_size, parse_sizes
from cudabench.measure import producer_main
from cudabench.peers import SYSTEMS, parse_systems
from cudabench.report import format_report, make_plot
from cudabench.runner import info_main, run_all
from cudabench.selftest import selftest


# ---- CLI ----------------------------------------------------------------------

def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="systems: " + ", ".join(f"{k} ({v})" for k, v in SYSTEMS.items())
                                 + "; aliases: usmipc, all")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma list, suffixes K/M/G (default %(default)s)")
    ap.add_argument("--systems", default="all", help="comma list of systems (default: all)")
    ap.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    ap.add_argument("--k", type=int, default=40, help="fresh buffers per size (default 40)")
    ap.add_argument("--k-large", type=int, default=10,
                    help="fresh buffers for sizes >= --large-threshold (default 10)")
    ap.add_argument("--large-threshold", default="512M", help="(default 512M)")
    ap.add_argument("--repeat-export", type=int, default=1000,
                    help="repeated exports of one buffer (default 1000)")
    ap.add_argument("--reopen", type=int, default=1000,
                    help="cached re-open open+close pairs (default 1000)")
    ap.add_argument("--torch-repeat", type=int, default=200,
                    help="torch repeated exports = cached rebuilds (each makes a ref-counter slot; default 200)")
    ap.add_argument("--bw-reps", type=int, default=20, help="bandwidth samples (default 20)")
    ap.add_argument("--staged-k", type=int, default=10, help="K for the host-staged baseline (default 10)")
    ap.add_argument("--staged-max", default="256M", help="largest host-staged size (default 256M)")
    ap.add_argument("--usmipc-filter", default=None,
                    help="usmipc device filter (default cuda:gpu:<--device>; host:cpu tests the plumbing)")
    ap.add_argument("--fd-transport", default=None, choices=["auto", "socket", "pidfd"],
                    help="set USMIPC_FD_TRANSPORT for usmipc (default: leave as is)")
    ap.add_argument("--system-timeout", type=float, default=180.0,
                    help="seconds per system before it is killed (default 180)")
    ap.add_argument("--msg-timeout", type=float, default=120.0,
                    help="seconds to wait for the consumer per size (default 120)")
    ap.add_argument("--json", default=None, help="write everything to this JSON file")
    ap.add_argument("--plot", default=None, help="write a PNG of export/first-open latency vs size")
    ap.add_argument("--selftest", action="store_true", help="format a fake results dict (no GPU) and exit")
    ap.add_argument("--_role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_system", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_cfg", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    return ap


def build_cfg(args):
    return {
        "sizes": parse_sizes(args.sizes),
        "systems": parse_systems(args.systems),
        "device": args.device,
        "k": args.k,
        "k_large": args.k_large,
        "large_threshold": parse_size(args.large_threshold),
        "repeat_export": args.repeat_export,
        "reopen": args.reopen,
        "torch_repeat": args.torch_repeat,
        "bw_reps": args.bw_reps,
        "staged_k": args.staged_k,
        "staged_max": parse_size(args.staged_max),
        "system_timeout": args.system_timeout,
        "msg_timeout": args.msg_timeout,
        "fd_transport": args.fd_transport,
        "usmipc_filter": args.usmipc_filter,
    }


def parse(argv):
    """argv -> (args, cfg), as the command line would give them."""
    args = build_parser().parse_args(argv)
    return args, build_cfg(args)


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args._role == "producer":
        producer_main(args._system, json.loads(args._cfg), args._out)
        return 0
    if args._role == "info":
        info_main(json.loads(args._cfg), args._out)
        return 0
    if args.selftest:
        return selftest(args, parse)
    try:
        cfg = build_cfg(args)
    except ValueError as e:
        ap.error(str(e))
    doc = run_all(args, cfg)
    text = format_report(doc)
    print(text)
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(dict(doc, report_markdown=text), f, indent=1, default=str)
            log(f"JSON written to {args.json}")
        except Exception as e:
            log(f"JSON not written: {errstr(e)}")
    if args.plot:
        try:
            make_plot(doc, args.plot)
            log(f"plot written to {args.plot}")
        except Exception as e:
            log(f"plot not written: {errstr(e)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
