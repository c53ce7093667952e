"""usmipc.torch's pickling on the host, where a GPU is not lent: the Python
and library time of ForkingPickler.dumps in the sender and .loads in a
receiver process, for routed CPU tensors over usmipc host memory (the path
CUDA tensors take, less the driver and the streams). Issue 24's speed work
is measured on the GPU (tests/gpu/torch_mp_bench.py, torch_mp_profile.py);
this bench shows on any machine whether a change to the Python or C of the
path moves it, side by side with torch's own file-descriptor sharing of
plain CPU tensors of the same shapes, and the pipe's floor: the pickled
bytes sent to the receiver, an empty message back.

    python3 bench/bench_torch_mp_host.py [--n 200] [--profile]

Cases: one tensor sent again and again; the Qwen2.5-1.5B state dict's 338
tensors at small shapes (float32, one allocation each), warm (the same
tensors every round, the receiver dropping each round's). Medians of n
calls, in microseconds, and the same for torch; --profile prints the
receiver's and the sender's top functions (cProfile).
"""
import argparse
import cProfile
import io
import multiprocessing
import os
import pstats
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def med_us(xs):
    return round(statistics.median(xs) * 1e6, 1)


def top(prof, n=18):
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    lines = s.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    return "\n".join(lines[start:start + n + 1])


def receiver(conn, mode, profile):
    from multiprocessing.reduction import ForkingPickler
    if mode == "usmipc":
        import usmipc.torch
        usmipc.torch.install()
    prof = cProfile.Profile() if profile else None
    while True:
        blobs = conn.recv()
        if blobs == "floor":  # bytes in, an empty message back
            while conn.recv_bytes():
                conn.send_bytes(b"")
            continue
        if blobs is None:
            conn.send(top(prof) if prof else "")
            return
        loads = []
        for b in blobs:
            if prof:
                prof.enable()
            t0 = time.perf_counter()
            obj = ForkingPickler.loads(b)
            loads.append(time.perf_counter() - t0)
            del obj
            if prof:
                prof.disable()
        conn.send(med_us(loads))


def make(torch, mode, spec):
    tensors = {}
    for name, shape in spec:
        n = 1
        for s in shape:
            n *= s
        if mode == "usmipc":
            import usmipc
            from usmipc.memory import MemoryUSMDevice
            mem = MemoryUSMDevice(4 * n, device=usmipc.Device("host:cpu"))
            t = torch.from_dlpack(mem).view(torch.float32).view(shape)
        else:
            t = torch.empty(shape, dtype=torch.float32).share_memory_()
        tensors[name] = t.fill_(1.0)
    return tensors


def run(mode, n, profile):
    import torch
    from multiprocessing.reduction import ForkingPickler
    from bench_weights import qwen2_spec
    if mode == "usmipc":
        import usmipc.torch
        usmipc.torch.install()
    else:
        # torch's default (fd) strategy holds a descriptor per storage until
        # the receiver loads it: n rounds of 338 run out of descriptors.
        torch.multiprocessing.set_sharing_strategy("file_system")
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=receiver, args=(there, mode, profile))
    p.start()
    spec = qwen2_spec(hidden=64, intermediate=128, heads=4, kv_heads=1,
                      head_dim=16, vocab=1024)
    cases = {"one tensor": make(torch, mode, [("w", (1024, 64))])["w"],
             "338-tensor state dict": make(torch, mode, spec)}
    out = {}
    sender_prof = cProfile.Profile() if profile else None
    for case, obj in cases.items():
        for rounds in (3, n):  # warm-up, then measured
            blobs, dumps = [], []
            for _ in range(rounds):
                if sender_prof and rounds == n:
                    sender_prof.enable()
                t0 = time.perf_counter()
                b = ForkingPickler.dumps(obj)
                dumps.append(time.perf_counter() - t0)
                if sender_prof and rounds == n:
                    sender_prof.disable()
                blobs.append(bytes(b))
            here.send(blobs)
            loads = here.recv()
        floor = []
        here.send("floor")
        for b in blobs[:50]:
            t0 = time.perf_counter()
            here.send_bytes(b)
            here.recv_bytes()
            floor.append(time.perf_counter() - t0)
        here.send_bytes(b"")
        out[case] = (med_us(dumps), loads, len(blobs[0]), med_us(floor))
    here.send(None)
    receiver_top = here.recv()
    p.join(30)
    return out, top(sender_prof) if sender_prof else "", receiver_top


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--modes", default="usmipc,torch")
    args = ap.parse_args()
    print(f"== {time.strftime('%Y-%m-%d %H:%M:%S')}, n {args.n}, "
          f"{os.cpu_count()} cpus")
    print("| case | mode | dumps us | loads us | dumps+loads us | bytes |"
          " the bytes to the receiver and back, us |")
    print("|---|---|---:|---:|---:|---:|---:|")
    modes = args.modes.split(",")
    if len(modes) > 1:  # each in a process of its own: nothing installed
        import subprocess
        for mode in modes:
            argv = [sys.executable, __file__, "--n", str(args.n), "--modes",
                    mode] + (["--profile"] if args.profile else [])
            out = subprocess.run(argv, check=True, stdout=subprocess.PIPE,
                                 text=True).stdout
            print(out.split("|---|---|---:|---:|---:|---:|---:|\n", 1)[1],
                  end="")
        return
    tops = []
    for mode in modes:
        res, st, rt = run(mode, args.n, args.profile)
        for case, (d, lo, nb, fl) in res.items():
            print(f"| {case} | {mode} | {d} | {lo} | {round(d + lo, 1)} |"
                  f" {nb} | {fl} |")
        tops.append((mode, st, rt))
    for mode, st, rt in tops:
        if st:
            print(f"--- {mode}: sender (dumps)\n{st}")
            print(f"--- {mode}: receiver (loads)\n{rt}")


if __name__ == "__main__":
    main()
