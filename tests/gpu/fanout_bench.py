"""Fan-out on one GPU (issue 23, item 4): one handoff's bytes to N consumer
processes released together by a barrier, each opening the same bytes
(opens only: open_shared with a stream, synchronized), cold (first open:
every allocation imported) and warm (the same bundle's next handoff, the
previous tree closed). The slowest consumer's open is compared with a lone
consumer's in the same run (target: <= 1.5x). The producer makes one
to_bytes(consumers=N) per round (one event, one ticket) and wait_released()
waits for all N.

The floor beside it, in the same run: the bare driver's fan-out, N
processes released by a barrier each opening the same segments' legacy
handles (torch's own, from _share_cuda_) with cuIpcOpenMemHandle through
ctypes, every round cold (each closes them after). If the slowest of N
raw consumers is as far from a lone one as usmipc's cold fan-out, the
driver is what serializes the imports.

The machine's own floor, also in the same run: the same fixed CPU work
(a CRC of 256 KB in cache) in 1 and in N processes released by a barrier,
no GPU: a warm open is CPU work alone, and N processes sharing cores (SMT)
and a cache slow each other by that ratio whatever the work is
(cpu_ratio). templated_*: the warm rounds after the first, which makes
the bundle's template.

  python3 tests/gpu/fanout_bench.py [--consumers 8] [--layout qwen|moe]
      [--rounds 5] [--json out.json] [--no-raw] [--unordered-too]

--unordered-too repeats the usmipc fan-out with share(ordered=False): no
event recorded, none waited on by the consumers' streams. If the
unordered ratio is near cpu_ratio while the ordered one is not, the
stream's wait on the producer's interprocess event is what spreads.
"""
import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from update_bench import moe_spec, qwen_spec  # noqa: E402


def consumer(conn, barrier):
    import torch
    import usmipc
    torch.cuda.init()
    s = torch.cuda.Stream()
    tree = None
    while True:
        raw = conn.recv()
        if raw is None:
            break
        if tree is not None:
            usmipc.close_shared(tree)
        before = usmipc.stats()
        barrier.wait()
        t0 = time.perf_counter()
        tree = usmipc.open_shared(raw, stream=s)
        t1 = time.perf_counter()
        s.synchronize()
        t2 = time.perf_counter()
        after = usmipc.stats()
        usmipc.release_shared(tree, stream=s)
        # The open's own split and what it did (the counters that moved):
        # where a slow consumer's time went.
        moved = {k: after[k] - before[k] for k in after
                 if after[k] != before.get(k)}
        conn.send(((t2 - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3, moved))
    conn.send("bye")


def raw_consumer(conn, barrier):
    import ctypes
    import torch
    torch.zeros(1, device="cuda")  # the primary context, current here
    cuda = ctypes.CDLL("libcuda.so.1")
    class Handle(ctypes.Structure):  # CUipcMemHandle, passed by value
        _fields_ = [("reserved", ctypes.c_char * 64)]
    open_ = cuda.cuIpcOpenMemHandle_v2
    open_.argtypes = [ctypes.POINTER(ctypes.c_uint64), Handle, ctypes.c_uint]
    close = cuda.cuIpcCloseMemHandle
    close.argtypes = [ctypes.c_uint64]
    while True:
        handles = conn.recv()
        if handles is None:
            break
        # torch's handle bytes lead with a byte naming the kind (a
        # cudaMalloc segment's): the driver's 64 bytes are the last.
        bufs = [Handle.from_buffer_copy(h[-64:]) for h in handles]
        ptrs = []
        barrier.wait()
        t0 = time.perf_counter()
        for b in bufs:
            p = ctypes.c_uint64()
            rc = open_(ctypes.byref(p), b, 1)  # LAZY_ENABLE_PEER_ACCESS
            assert rc == 0, rc
            ptrs.append(p.value)
        dt = (time.perf_counter() - t0) * 1e3
        for p in ptrs:
            close(p)
        conn.send(dt)
    conn.send("bye")


def cpu_consumer(conn, barrier):
    """The machine's own fan-out: the same fixed CPU work (a CRC of 256 KB
    held in cache) in each of n processes released by one barrier, no GPU
    and no usmipc. Its slowest-to-lone ratio is what n identical CPU-bound
    processes cost each other here (cores shared by SMT, one cache), the
    floor under a warm open's ratio, which is CPU work alone."""
    import zlib
    buf = bytes(range(256)) * 1024
    while True:
        msg = conn.recv()
        if msg is None:
            break
        zlib.crc32(buf)  # warm
        barrier.wait()
        t0 = time.perf_counter()
        zlib.crc32(buf)
        conn.send((time.perf_counter() - t0) * 1e3)
    conn.send("bye")


def run_cpu(n, rounds):
    pipes, procs, barrier = start(n, cpu_consumer)
    out = []
    for _ in range(rounds):
        for c in pipes:
            c.send(True)
        out.append(max(c.recv() for c in pipes))
    stop(pipes, procs)
    return out


def start(n, target):
    """n consumer processes of target, released together by one barrier:
    (the producer's ends of their pipes, the processes, the barrier). The
    caller holds the barrier until stop(): once it is collected its
    semaphores go, and a child still starting cannot unpickle it."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n)
    pipes, procs = [], []
    for _ in range(n):
        here, there = ctx.Pipe()
        p = ctx.Process(target=target, args=(there, barrier))
        p.start()
        pipes.append(here)
        procs.append(p)
    return pipes, procs, barrier


def stop(pipes, procs):
    for c in pipes:
        c.send(None)
        c.recv()
    for p in procs:
        p.join(60)


def state_dict(spec):
    import torch
    return {k: torch.full(s, 1.0, dtype=torch.bfloat16, device="cuda")
            for k, s in spec}


def run_raw(n, spec, rounds):
    pipes, procs, barrier = start(n, raw_consumer)
    state = state_dict(spec)
    handles = list(dict.fromkeys(
        bytes(t.untyped_storage()._share_cuda_()[1]) for t in state.values()))
    out = []
    for _ in range(rounds):
        for c in pipes:
            c.send(handles)
        out.append(max(c.recv() for c in pipes))
    stop(pipes, procs)
    return out, len(handles)


def run(n, spec, rounds, ordered=True):
    import usmipc
    pipes, procs, barrier = start(n, consumer)
    state = state_dict(spec)  # held here for the whole run
    if not ordered:  # the work that made state is done before the bytes go
        import torch
        torch.cuda.synchronize()
    bundle = usmipc.share(state, release=True, ordered=ordered)
    out = []
    for r in range(rounds):
        raw = bundle.to_bytes(consumers=n)  # one event, one ticket
        for c in pipes:
            c.send(raw)
        got = [c.recv() for c in pipes]
        bundle.wait_released()
        slowest = max(got, key=lambda g: g[0])
        out.append(slowest[0])
        print(f"  {n} consumer(s), round {r}: slowest {slowest[0]:.3f} ms "
              f"(open {slowest[1]:.3f}, synchronize {slowest[2]:.3f}; "
              f"fastest {min(g[0] for g in got):.3f}); its counters: "
              f"{slowest[3]}", flush=True)
    stop(pipes, procs)
    sent, back = bundle.releases
    assert sent == back == n * rounds, bundle.releases
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--consumers", type=int, default=8)
    ap.add_argument("--layout", default="qwen", choices=["qwen", "moe"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--no-raw", action="store_true",
                    help="leave out the bare driver's fan-out")
    ap.add_argument("--unordered-too", action="store_true",
                    help="the warm fan-out again with share(ordered=False):"
                    " no event for the consumers' streams to wait on, to "
                    "see whether that wait is what spreads under N")
    a = ap.parse_args()
    spec = qwen_spec() if a.layout == "qwen" else moe_spec()
    lone = run(1, spec, a.rounds)
    many = run(a.consumers, spec, a.rounds)
    res = {"layout": a.layout, "tensors": len(spec), "consumers": a.consumers,
           "lone_cold_ms": lone[0], "lone_warm_ms": statistics.median(lone[1:]),
           "slowest_cold_ms": many[0],
           "slowest_warm_ms": statistics.median(many[1:])}
    res["cold_ratio"] = res["slowest_cold_ms"] / res["lone_cold_ms"]
    res["warm_ratio"] = res["slowest_warm_ms"] / res["lone_warm_ms"]
    if a.rounds >= 4:
        # The first warm round is the bundle's second open, which makes its
        # template (a bundle opened before); the later ones use it.
        res["lone_templated_ms"] = statistics.median(lone[2:])
        res["slowest_templated_ms"] = statistics.median(many[2:])
        res["templated_ratio"] = (res["slowest_templated_ms"]
                                  / res["lone_templated_ms"])
    if a.unordered_too:
        u_lone = run(1, spec, a.rounds, ordered=False)
        u_many = run(a.consumers, spec, a.rounds, ordered=False)
        res["unordered_lone_warm_ms"] = statistics.median(u_lone[1:])
        res["unordered_slowest_warm_ms"] = statistics.median(u_many[1:])
        res["unordered_warm_ratio"] = (res["unordered_slowest_warm_ms"]
                                       / res["unordered_lone_warm_ms"])
    cpu_lone = run_cpu(1, 2 * a.rounds)
    cpu_many = run_cpu(a.consumers, 2 * a.rounds)
    res["cpu_lone_ms"] = statistics.median(cpu_lone)
    res["cpu_slowest_ms"] = statistics.median(cpu_many)
    res["cpu_ratio"] = res["cpu_slowest_ms"] / res["cpu_lone_ms"]
    if not a.no_raw:
        raw_lone, segments = run_raw(1, spec, a.rounds)
        raw_many, _ = run_raw(a.consumers, spec, a.rounds)
        res["segments"] = segments
        res["raw_lone_ms"] = statistics.median(raw_lone)
        res["raw_slowest_ms"] = statistics.median(raw_many)
        res["raw_ratio"] = res["raw_slowest_ms"] / res["raw_lone_ms"]
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
