"""Handoff latency on one GPU: from "the producer's kernel is done" to "the
consumer's kernel may start", measured with %globaltimer stamps that both
kernels write (one clock: the same GPU), through a pipe, side by side:

  usmipc-device  ordered handle; the consumer's stream waits on the device
  usmipc-host    ordered handle; the consumer's host waits, then launches
  torch.mp       torch.multiprocessing queue (an IPC event per share; the
                 consumer's current stream waits for it)
  cupy-sync      the producer synchronizes its stream on the host, then
                 sends a cudaIpcMemHandle (opened once by the consumer)
  in-process     the floor: one process, two streams, a plain event (no
                 second context: no switch between processes' contexts)

Per trial the producer launches a kernel that spins SPIN_US and then stamps
t_done into the shared buffer, and hands the buffer over at once (cupy-sync
after its host synchronize); the consumer, waiting on the pipe, makes its
stream wait as the method says and launches a kernel that stamps t_start.
Latency = t_start - t_done (median over --trials). Sizes: 4 KiB, 256 MiB.

  python3 bench/bench_events.py [--trials 100] [--json FILE]
"""
import argparse
import json
import statistics
import sys
import time

SPIN_US = 3000

KERNELS = r"""
extern "C" __global__ void spin_stamp(unsigned long long ns,
                                      unsigned long long *done) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); }
    while (t - t0 < ns);
    __threadfence_system();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    *done = t;
}
extern "C" __global__ void stamp(unsigned long long *out) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    *out = t;
}
"""


def kernels():
    import cupy as cp
    mod = cp.RawModule(code=KERNELS)
    return mod.get_function("spin_stamp"), mod.get_function("stamp")


# ---- the consumer: one process per method, a line per trial ----------------

def consumer_usmipc(conn_in, conn_out, wait_on_device):
    import cupy as cp
    import usmipc
    from usmipc.memory import IPCMemoryHandle
    _, stamp = kernels()
    dev = usmipc.Device("cuda:gpu:0")
    stream = cp.cuda.Stream(non_blocking=True)
    out = cp.zeros(1, dtype=cp.uint64)
    conn_out.send("ready")
    while True:
        raw = conn_in.recv()
        if raw is None:
            break
        if isinstance(raw, tuple):
            # ("reopen", raw): an ordered cached re-open from Python (the
            # ring event opened already) plus the stream wait, and close.
            import time as _t
            samples = []
            for _ in range(50):
                t0 = _t.perf_counter()
                for _ in range(100):
                    IPCMemoryHandle.close_mapping(
                        IPCMemoryHandle.open(raw[1], dev, stream=stream))
                samples.append((_t.perf_counter() - t0) / 100 * 1e6)
            samples.sort()
            conn_out.send(samples[len(samples) // 2])
            continue
        if wait_on_device:
            m = IPCMemoryHandle.open(raw, dev, stream=stream)
        else:
            m = IPCMemoryHandle.open(raw, dev)  # the host waits
        with stream:
            stamp((1,), (1,), (out,))
            done = cp.from_dlpack(m).view(cp.uint64)[:1].copy()
        stream.synchronize()
        IPCMemoryHandle.close_mapping(m)
        conn_out.send(int(out.get()[0]) - int(done.get()[0]))


def consumer_torch(q_in, conn_out):
    import cupy as cp
    import torch
    _, stamp = kernels()
    out = cp.zeros(1, dtype=cp.uint64)
    conn_out.send("ready")
    while True:
        t = q_in.get()
        if t is None:
            break
        # torch's rebuild made the current stream wait for the share's event.
        s = torch.cuda.current_stream()
        with cp.cuda.ExternalStream(s.cuda_stream):
            stamp((1,), (1,), (out,))
            done = cp.from_dlpack(t.view(torch.int64)[:1]).copy()
        s.synchronize()
        del t
        conn_out.send(int(out.get()[0]) - int(done.get()[0]))


def consumer_cupy(conn_in, conn_out):
    import cupy as cp
    _, stamp = kernels()
    stream = cp.cuda.Stream(non_blocking=True)
    out = cp.zeros(1, dtype=cp.uint64)
    opened = {}
    conn_out.send("ready")
    while True:
        raw = conn_in.recv()
        if raw is None:
            break
        if raw not in opened:
            opened[raw] = cp.cuda.runtime.ipcOpenMemHandle(raw)
        ptr = opened[raw]
        mem = cp.cuda.UnownedMemory(ptr, 8, None)
        done_arr = cp.ndarray((1,), cp.uint64, cp.cuda.MemoryPointer(mem, 0))
        with stream:
            stamp((1,), (1,), (out,))
            done = done_arr.copy()
        stream.synchronize()
        conn_out.send(int(out.get()[0]) - int(done.get()[0]))


# ---- the producer -----------------------------------------------------------

def answer(conn, proc, timeout=60):
    """The consumer's next message; a dead or stuck consumer ends the run
    with a message instead of a hang."""
    if not conn.poll(timeout):
        proc.kill()
        raise SystemExit(f"the consumer did not answer in {timeout} s "
                         f"(exit code {proc.exitcode})")
    return conn.recv()


def run_method(method, nbytes, trials):
    import multiprocessing as mp
    import cupy as cp
    spin, stamp = kernels()
    ctx = mp.get_context("spawn")
    results = []
    if method == "in-process":
        # The floor: one process, two streams, a plain event between them
        # (no second context for the GPU to switch to).
        buf = cp.zeros(nbytes // 8, dtype=cp.uint64)
        out = cp.zeros(1, dtype=cp.uint64)
        a = cp.cuda.Stream(non_blocking=True)
        b = cp.cuda.Stream(non_blocking=True)
        for i in range(trials + 3):
            cp.cuda.Device().synchronize()
            with a:
                spin((1,), (1,), (cp.uint64(SPIN_US * 1000), buf))
            ev = a.record()
            b.wait_event(ev)
            with b:
                stamp((1,), (1,), (out,))
            b.synchronize()
            if i >= 3:
                results.append(int(out.get()[0]) - int(buf[:1].get()[0]))
        return results
    if method == "torch.mp":
        import torch
        import torch.multiprocessing as tmp
        tctx = tmp.get_context("spawn")
        q = tctx.Queue()
        r_out, w_out = tctx.Pipe(duplex=False)
        p = tctx.Process(target=consumer_torch, args=(q, w_out))
        p.start()
        assert answer(r_out, p) == "ready"
        t = torch.zeros(nbytes // 8, dtype=torch.int64, device="cuda:0")
        s = torch.cuda.current_stream()
        for i in range(trials + 3):
            torch.cuda.synchronize()
            with cp.cuda.ExternalStream(s.cuda_stream):
                spin((1,), (1,), (cp.uint64(SPIN_US * 1000),
                                  cp.uint64(t.data_ptr())))
            q.put(t)
            lat = answer(r_out, p)
            if i >= 3:
                results.append(lat)
        q.put(None)
        p.join()
        return results

    from usmipc.memory import IPCMemoryHandle
    r_in, w_in = ctx.Pipe(duplex=False)
    r_out, w_out = ctx.Pipe(duplex=False)
    if method == "cupy-sync":
        p = ctx.Process(target=consumer_cupy, args=(r_in, w_out))
    else:
        p = ctx.Process(target=consumer_usmipc,
                        args=(r_in, w_out, method == "usmipc-device"))
    p.start()
    assert answer(r_out, p) == "ready"
    buf = cp.zeros(nbytes // 8, dtype=cp.uint64)
    stream = cp.cuda.Stream(non_blocking=True)
    cupy_handle = cp.cuda.runtime.ipcGetMemHandle(buf.data.ptr)
    for i in range(trials + 3):
        stream.synchronize()
        with stream:
            spin((1,), (1,), (cp.uint64(SPIN_US * 1000), buf))
        h = None
        if method == "cupy-sync":
            stream.synchronize()
            w_in.send(cupy_handle)
        else:
            # The handle lives until the consumer answered: another
            # library's memory is exported while a handle of it lives.
            h = IPCMemoryHandle(buf, stream=stream)
            w_in.send(h.to_bytes())
        lat = answer(r_out, p)
        del h
        if i >= 3:
            results.append(lat)
    if method == "usmipc-device":
        stream.synchronize()
        h = IPCMemoryHandle(buf, stream=stream)
        w_in.send(("reopen", h.to_bytes()))
        run_method.reopen_us = answer(r_out, p)
        del h
    w_in.send(None)
    p.join()
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--json")
    args = ap.parse_args()
    methods = ["in-process", "usmipc-device", "usmipc-host", "torch.mp",
               "cupy-sync"]
    table = {}
    print("| method | 4 KiB: median us (p10, p90) | 256 MiB |")
    print("|---|---:|---:|")
    for method in methods:
        row = {}
        for nbytes in (4096, 256 << 20):
            lat = [x / 1000 for x in run_method(method, nbytes, args.trials)]
            lat.sort()
            row[nbytes] = {"median_us": statistics.median(lat),
                           "p10_us": lat[len(lat) // 10],
                           "p90_us": lat[(len(lat) * 9) // 10],
                           "n": len(lat)}
        table[method] = row
        cells = ["%.1f (%.1f, %.1f)" % (r["median_us"], r["p10_us"], r["p90_us"])
                 for r in row.values()]
        print(f"| {method} | " + " | ".join(cells) + " |", flush=True)
    reopen = getattr(run_method, "reopen_us", None)
    if reopen is not None:
        print(f"ordered cached re-open + stream wait + close from Python: "
              f"{reopen:.2f} us (median of 50 x 100)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"spin_us": SPIN_US, "trials": args.trials,
                       "python_ordered_reopen_us": reopen,
                       "date": time.strftime("%Y-%m-%d"),
                       "results": {m: {str(k): v for k, v in r.items()}
                                   for m, r in table.items()}}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
