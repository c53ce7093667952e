"""Fresh native exports from Python, ordered, beside CuPy and the driver
(issue 23, item 5: at most 3 us from Python with ordering on).

Each round allocates K fresh buffers per system (usmipc MemoryUSMDevice
with ipc="native": cuMemAlloc; CuPy cupy.cuda.Memory: cudaMalloc; the
driver's cuMemAlloc through ctypes), then times each export on its own:

- usmipc ordered:   IPCMemoryHandle(m).to_bytes() (the default)
- usmipc unordered: IPCMemoryHandle(m, ordered=False).to_bytes()
- CuPy:             cupy.cuda.runtime.ipcGetMemHandle(ptr)
- driver:           cuIpcGetMemHandle through ctypes (the floor, ctypes'
                    own ~0.1-0.3 us included)

Systems take turns within each round, rounds repeat, and the figure is the
median of every call's time, with p10 and p90. USMIPC_ORDER_REUSE in the
environment selects the ordering path (run it with 1 and 0 side by side);
event_records per round says how many event records the ordered exports
made.

    python tests/gpu/export_bench.py [--k 500] [--rounds 7] [--json OUT]
"""
import argparse
import ctypes
import json
import os
import statistics
import time

import usmipc
from usmipc.memory import IPCMemoryHandle, MemoryUSMDevice


def quantiles(xs):
    xs = sorted(xs)
    return {"median": statistics.median(xs),
            "p10": xs[len(xs) // 10], "p90": xs[len(xs) * 9 // 10],
            "n": len(xs)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sizes", default="4096,1048576")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = usmipc.Device("cuda:gpu:0")
    import cupy as cp
    cp.cuda.Device(0).use()
    cuda = ctypes.CDLL("libcuda.so.1")
    cu_alloc = cuda.cuMemAlloc_v2
    cu_alloc.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    cu_free = cuda.cuMemFree_v2
    cu_free.argtypes = [ctypes.c_uint64]
    cu_ipc = cuda.cuIpcGetMemHandle
    cu_ipc.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
    handle_buf = ctypes.create_string_buffer(64)
    # cupy made the primary context current on this thread: the ctypes
    # calls run in it.
    m = MemoryUSMDevice(4096, device=dev, ipc="native")
    IPCMemoryHandle(m).to_bytes()
    IPCMemoryHandle(m, ordered=False).to_bytes()
    del m
    perf = time.perf_counter_ns
    results = {}
    for size in map(int, args.sizes.split(",")):
        times = {"usmipc ordered": [], "usmipc unordered": [], "CuPy": [],
                 "driver (ctypes)": []}
        records = []
        for _ in range(args.rounds):
            keep = []
            mems = [MemoryUSMDevice(size, device=dev, ipc="native")
                    for _ in range(2 * args.k)]
            cmems = [cp.cuda.Memory(size) for _ in range(args.k)]
            ptrs = []
            for _ in range(args.k):
                p = ctypes.c_uint64()
                assert cu_alloc(ctypes.byref(p), size) == 0
                ptrs.append(p.value)
            cp.cuda.runtime.deviceSynchronize()
            before = usmipc.stats()["event_records"]
            t = times["usmipc ordered"]
            for mem in mems[:args.k]:
                t0 = perf()
                h = IPCMemoryHandle(mem)
                h.to_bytes()
                t.append((perf() - t0) / 1e3)
                keep.append(h)
            records.append(usmipc.stats()["event_records"] - before)
            t = times["usmipc unordered"]
            for mem in mems[args.k:]:
                t0 = perf()
                h = IPCMemoryHandle(mem, ordered=False)
                h.to_bytes()
                t.append((perf() - t0) / 1e3)
                keep.append(h)
            t = times["CuPy"]
            ipc = cp.cuda.runtime.ipcGetMemHandle
            for cm in cmems:
                t0 = perf()
                ipc(cm.ptr)
                t.append((perf() - t0) / 1e3)
            t = times["driver (ctypes)"]
            for p in ptrs:
                t0 = perf()
                rc = cu_ipc(handle_buf, p)
                t.append((perf() - t0) / 1e3)
                assert rc == 0, rc
            keep.clear()
            del mems, cmems
            for p in ptrs:
                cu_free(p)
        results[size] = {name: quantiles(ts) for name, ts in times.items()}
        results[size]["event_records_per_round"] = records
    reuse = os.environ.get("USMIPC_ORDER_REUSE", "1 (default)")
    print(f"fresh native exports, USMIPC_ORDER_REUSE={reuse}, "
          f"{args.rounds} rounds x {args.k} buffers, us per export")
    print("| size | system | median | p10 | p90 |")
    print("|---|---|---|---|---|")
    for size, r in results.items():
        for name in ("usmipc ordered", "usmipc unordered", "CuPy",
                     "driver (ctypes)"):
            q = r[name]
            print(f"| {size} | {name} | {q['median']:.2f} | {q['p10']:.2f} "
                  f"| {q['p90']:.2f} |")
        print(f"| {size} | event records per {args.k} ordered exports | "
              f"{r['event_records_per_round']} | | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"order_reuse": reuse, "k": args.k,
                       "rounds": args.rounds,
                       "results": {str(k): v for k, v in results.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
