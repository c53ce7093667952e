"""The per-buffer cost of sharing N buffers on the host backend (issue 11):
usmipc pool blocks, one usmipc allocation per buffer, and
multiprocessing.shared_memory, for N from 1 to 10,000, in one run.

For each N and method: the producer allocates N buffers of 4 KiB and makes
their handles (names for shared_memory); a consumer process, started
before and waiting on a pipe, opens all N and reads a byte of each; the
time is from the producer's first allocation to the consumer's answer,
divided by N (median of --rounds). Descriptors: those the producer holds
for the N buffers, and those the consumer holds with all N open. Run it
under the default `ulimit -n 1024` to see who runs out.

  python3 bench/bench_pool_curve.py [--rounds 5] [--json FILE]
"""
import argparse
import json
import multiprocessing as mp
import os
import statistics
import time


def consumer(conn):
    import usmipc
    from multiprocessing import shared_memory
    from usmipc.memory import IPCMemoryHandle
    dev = usmipc.Device("host:cpu")
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        method, items = msg
        fds0 = len(os.listdir("/proc/self/fd"))
        if method == "shared_memory":
            opened = [shared_memory.SharedMemory(name=n) for n in items]
            total = sum(s.buf[0] for s in opened)
        else:
            opened = [IPCMemoryHandle.open(r, dev, ordered=False) for r in items]
            total = sum(bytes(memoryview(m)[:1])[0] for m in opened)
        fds = len(os.listdir("/proc/self/fd")) - fds0
        conn.send((total, fds))
        for o in opened:
            if method == "shared_memory":
                o.close()
            else:
                IPCMemoryHandle.close_mapping(o)


def produce(method, n, dev, pool_cls, handle_cls, mem_cls):
    from multiprocessing import shared_memory
    keep = []
    if method == "shared_memory":
        for _ in range(n):
            s = shared_memory.SharedMemory(create=True, size=4096)
            s.buf[0] = 1
            keep.append(s)
        return keep, [s.name for s in keep]
    if method == "usmipc-pool":
        pool = pool_cls(device=dev)
        blocks = [pool.allocate(4096) for _ in range(n)]
    else:
        blocks = [mem_cls(4096, device=dev) for _ in range(n)]
    raws = []
    for b in blocks:
        b.memset(1)
        raws.append(handle_cls(b, ordered=False).to_bytes())
    return blocks, raws


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    import usmipc
    from usmipc.memory import IPCMemoryHandle, MemoryPool, MemoryUSMDevice
    dev = usmipc.Device("host:cpu")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=consumer, args=(child,))
    proc.start()
    assert parent.recv() == "ready"
    methods = ["usmipc-pool", "usmipc-alloc", "shared_memory"]
    results = {}
    print("| buffers | " + " | ".join(
        f"{m}: us/buffer (fds producer / consumer)" for m in methods) + " |")
    print("|---:|" + "---:|" * len(methods))
    for n in (1, 10, 100, 1000, 10000):
        row = {}
        for m in methods:
            times, fds, pfds = [], 0, 0
            failed = None
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                pfds0 = len(os.listdir("/proc/self/fd"))
                try:
                    keep, items = produce(m, n, dev, MemoryPool,
                                          IPCMemoryHandle, MemoryUSMDevice)
                except (OSError, Exception) as e:  # out of descriptors
                    failed = "fails: " + (getattr(e, "name", None) or
                                          getattr(e, "strerror", None) or
                                          type(e).__name__)
                    break
                pfds = len(os.listdir("/proc/self/fd")) - pfds0
                parent.send((m, items))
                total, fds = parent.recv()
                times.append((time.perf_counter() - t0) / n * 1e6)
                assert total == n, (m, n, total)
                if m == "shared_memory":
                    for s in keep:
                        s.close()
                        s.unlink()
                del keep
            import gc
            gc.collect()
            row[m] = ({"failed": failed} if failed else
                      {"us_per_buffer": statistics.median(times),
                       "consumer_fds": fds, "producer_fds": pfds})
        results[n] = row
        cells = []
        for m in methods:
            r = row[m]
            cells.append(r["failed"] if "failed" in r else "%.1f (%d / %d)" % (
                r["us_per_buffer"], r["producer_fds"], r["consumer_fds"]))
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
    parent.send(None)
    proc.join()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "rounds": args.rounds,
                       "results": {str(k): v for k, v in results.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
