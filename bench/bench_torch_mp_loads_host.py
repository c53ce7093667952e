"""The receiver's side of usmipc.torch on the host, alone: how long
ForkingPickler.loads takes in a receiver process for messages of routed CPU
tensors over usmipc host memory, and how much of it is the bundle's open
(usmipc.torch._open_group, timed by a wrapper). bench_torch_mp_host.py
times both sides; this one feeds the receiver many messages in batches
(a message is one handoff: loaded once, then freed by its sender), so that
a profiler attached to the receiver sees mostly its loads.

    python3 bench/bench_torch_mp_loads_host.py [--case state_dict|tensor]
        [--batches 4] [--per-batch 150] [--perf perf.data]

Medians over every message, in microseconds: loads, and the open within
it. --perf runs `perf record -g -p <receiver>` around the timed batches.
"""
import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def receiver(conn):
    from multiprocessing.reduction import ForkingPickler
    import usmipc.torch
    usmipc.torch.install()
    open_group = usmipc.torch._open_group
    opens = []

    def timed(device, raw):
        t0 = time.perf_counter()
        got = open_group(device, raw)
        opens.append(time.perf_counter() - t0)
        return got

    usmipc.torch._open_group = timed
    conn.send(os.getpid())
    loads = []
    warm = True
    while True:
        blobs = conn.recv()
        if blobs is None:
            break
        for b in blobs:
            t0 = time.perf_counter()
            obj = ForkingPickler.loads(b)
            loads.append(time.perf_counter() - t0)
            del obj
        if warm:  # the first batch warms up: not counted
            warm = False
            del loads[:], opens[:]
        conn.send("done")
    conn.send((statistics.median(loads) * 1e6,
               statistics.median(opens) * 1e6))


def state_dict(torch):
    import usmipc
    from usmipc.memory import MemoryUSMDevice
    from bench_weights import qwen2_spec
    spec = qwen2_spec(hidden=64, intermediate=128, heads=4, kv_heads=1,
                      head_dim=16, vocab=1024)
    out = {}
    for name, shape in spec:
        n = 1
        for s in shape:
            n *= s
        mem = MemoryUSMDevice(4 * n, device=usmipc.Device("host:cpu"))
        out[name] = torch.from_dlpack(mem).view(torch.float32).view(
            shape).fill_(1.0)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=("state_dict", "tensor"),
                    default="state_dict")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--per-batch", type=int, default=150)
    ap.add_argument("--perf", default=None)
    a = ap.parse_args()
    import torch
    import usmipc.torch
    from multiprocessing.reduction import ForkingPickler
    usmipc.torch.install()
    sd = state_dict(torch)
    obj = sd if a.case == "state_dict" else next(iter(sd.values()))
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=receiver, args=(there,))
    p.start()
    pid = here.recv()
    here.send([bytes(ForkingPickler.dumps(obj)) for _ in range(20)])  # warm
    here.recv()
    perf = None
    if a.perf:
        perf = subprocess.Popen(["perf", "record", "-g", "-o", a.perf, "-p",
                                 str(pid)], stderr=subprocess.DEVNULL)
        time.sleep(1)
    for _ in range(a.batches):
        here.send([bytes(ForkingPickler.dumps(obj))
                   for _ in range(a.per_batch)])
        here.recv()
    here.send(None)
    loads, opens = here.recv()
    if perf is not None:
        perf.send_signal(2)
        perf.wait()
    p.join()
    print(f"{a.case}: loads {loads:.1f} us, of which the open "
          f"{opens:.1f} us (medians of {a.batches * a.per_batch} "
          f"messages)")


if __name__ == "__main__":
    main()
