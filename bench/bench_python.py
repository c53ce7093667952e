"""Python-side IPC latency benchmark: usmipc next to multiprocessing.shared_memory.

One producer process allocates K fresh buffers per size and exports them; a
separately started consumer process (subprocess, not fork) opens each handle
once (a true first open), then times cached re-opens and closes. The same is
done in the same run with multiprocessing.shared_memory.SharedMemory
(create in the producer, attach by name in the consumer), as the baseline a
Python user would otherwise reach for.

    python bench/bench_python.py [--device host:cpu] [--json out.json]

Prints a Markdown table of medians (microseconds) and, with --json, all
figures with p10/p90.
"""
import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time

SIZES = [4 << 10, 1 << 20, 64 << 20, 256 << 20]
K = 40          # fresh buffers per size: each first open is really first
REPEAT = 20000  # iterations for the cached re-open loop


def summary(samples):
    s = sorted(samples)
    n = len(s)
    return {
        "median": statistics.median(s),
        "p10": s[max(0, n // 10 - 1)] if n >= 10 else s[0],
        "p90": s[min(n - 1, (9 * n) // 10)],
        "n": n,
    }


def us(t0, t1):
    return (t1 - t0) * 1e6


def fmt_size(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


# ---- consumer ---------------------------------------------------------------

def consumer(device_filter):
    import usmipc
    from usmipc.memory import IPCMemoryHandle
    from multiprocessing import shared_memory

    device = usmipc.Device(device_filter) if device_filter else None
    job = pickle.load(sys.stdin.buffer)
    out = {}
    for size, handles, shm_names in job:
        first = []
        mapped = []
        for raw in handles:
            t0 = time.perf_counter()
            m = IPCMemoryHandle.open(raw, device)
            t1 = time.perf_counter()
            first.append(us(t0, t1))
            mapped.append(m)
        # Cached re-open: the allocation is already open here, so an open is
        # a cache hit plus an object; time open+close pairs.
        raw = handles[0]
        loops = REPEAT if size <= (64 << 20) else REPEAT // 4
        reopen = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(loops):
                IPCMemoryHandle.close_mapping(IPCMemoryHandle.open(raw, device))
            t1 = time.perf_counter()
            reopen.append(us(t0, t1) / loops)
        close = []
        for m in mapped:
            t0 = time.perf_counter()
            IPCMemoryHandle.close_mapping(m)
            t1 = time.perf_counter()
            close.append(us(t0, t1))
        attach, detach = [], []
        for name in shm_names:
            t0 = time.perf_counter()
            s = shared_memory.SharedMemory(name=name)
            t1 = time.perf_counter()
            attach.append(us(t0, t1))
            # Before Python 3.13 an attach registers the segment for removal
            # at exit, as if this process owned it; the producer owns it.
            try:
                from multiprocessing import resource_tracker
                resource_tracker.unregister(s._name, "shared_memory")
            except Exception:
                pass
            t0 = time.perf_counter()
            s.close()
            t1 = time.perf_counter()
            detach.append(us(t0, t1))
        out[size] = {
            "usmipc_first_open": summary(first),
            "usmipc_cached_reopen_open_close": summary(reopen),
            "usmipc_close": summary(close),
            "shm_attach": summary(attach),
            "shm_close": summary(detach),
        }
    sys.stdout.write(json.dumps(out))


# ---- producer ---------------------------------------------------------------

def run_transport(device_filter, transport, sizes):
    import usmipc
    from usmipc.memory import MemoryUSMDevice, IPCMemoryHandle
    from multiprocessing import shared_memory

    device = usmipc.Device(device_filter) if device_filter else usmipc.Device()
    results = {}
    job = []
    keep = []
    for size in sizes:
        mems = [MemoryUSMDevice(size, device=device) for _ in range(K)]
        first_export, repeat_export, handles = [], [], []
        for m in mems:
            t0 = time.perf_counter()
            h = IPCMemoryHandle(m)
            raw = h.to_bytes()
            t1 = time.perf_counter()
            first_export.append(us(t0, t1))
            handles.append(raw)
            keep.append(h)
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(2000):
                IPCMemoryHandle(mems[0]).to_bytes()
            t1 = time.perf_counter()
            repeat_export.append(us(t0, t1) / 2000)
        shm_create, names, shms = [], [], []
        for _ in range(K):
            t0 = time.perf_counter()
            s = shared_memory.SharedMemory(create=True, size=size)
            t1 = time.perf_counter()
            shm_create.append(us(t0, t1))
            names.append(s.name)
            shms.append(s)
        results[size] = {
            "usmipc_first_export": summary(first_export),
            "usmipc_repeat_export": summary(repeat_export),
            "shm_create": summary(shm_create),
        }
        job.append((size, handles, names))
        keep.append(mems)
        keep.append(shms)
    env = dict(os.environ, USMIPC_FD_TRANSPORT=transport)
    cmd = [sys.executable, os.path.abspath(__file__), "--consumer"]
    if device_filter:
        cmd += ["--device", device_filter]
    proc = subprocess.run(cmd, input=pickle.dumps(job), env=env,
                          capture_output=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"consumer failed:\n{proc.stderr.decode()}")
    for size, figures in json.loads(proc.stdout).items():
        results[int(size)].update(figures)
    for group in keep:
        if isinstance(group, list) and group and hasattr(group[0], "unlink"):
            for s in group:
                s.close()
                s.unlink()
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--consumer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sizes", default=None,
                    help="comma-separated sizes in bytes (default 4K,1M,64M,256M)")
    args = ap.parse_args()
    if args.consumer:
        return consumer(args.device)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else SIZES
    all_results = {t: run_transport(args.device, t, sizes)
                   for t in ("socket", "pidfd", "procfd")}
    import usmipc
    dev = usmipc.Device(args.device) if args.device else usmipc.Device()
    print(f"# usmipc Python IPC latency on {dev.filter_string} ({dev.name}), "
          f"median microseconds, K={K} fresh buffers per size\n")
    print("| size | export (first) | export (repeat) | first open, socket | "
          "first open, pidfd | first open, procfd | cached re-open (open+close) "
          "| close | SharedMemory create | SharedMemory attach | "
          "SharedMemory close |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        s = all_results["socket"][size]
        p = all_results["pidfd"][size]
        f = all_results["procfd"][size]
        row = [fmt_size(size),
               s["usmipc_first_export"]["median"],
               s["usmipc_repeat_export"]["median"],
               s["usmipc_first_open"]["median"],
               p["usmipc_first_open"]["median"],
               f["usmipc_first_open"]["median"],
               min(s["usmipc_cached_reopen_open_close"]["median"],
                   p["usmipc_cached_reopen_open_close"]["median"]),
               s["usmipc_close"]["median"],
               s["shm_create"]["median"],
               s["shm_attach"]["median"],
               s["shm_close"]["median"]]
        print("| " + " | ".join([row[0]] + [f"{v:.2f}" for v in row[1:]]) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev.filter_string, "name": dev.name,
                       "results": {t: {str(k): v for k, v in r.items()}
                                   for t, r in all_results.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
