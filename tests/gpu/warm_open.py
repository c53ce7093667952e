"""Warm means warm, on the GPU, with the library's defaults: a producer keeps
one bundle of a state dict from PyTorch's caching allocator (more caching-
allocator segments and more bytes than the import cache's old bounds, 64
and 1 GiB) and hands its bytes over every round after an in-place update; a
consumer opens them, checks every tensor, and closes everything before the
next round, as an inference engine drops its tensors between weight
updates. From the second round on, an open must make no driver import or
query, take no descriptor and send no broker request (usmipc.stats() of
the consumer), and read the round's values.

  python3 tests/gpu/warm_open.py [--tensors 400] [--mib 12] [--rounds 4]

Prints one line per round and exits 1 when a warm round did driver or
transport work or read wrong values.
"""
import argparse
import multiprocessing as mp
import sys
import time


def consumer(conn, rounds):
    import torch
    import usmipc
    dev = usmipc.Device("cuda:gpu:0")
    torch.cuda.init()
    out = []
    for r in range(rounds):
        raw, expect = conn.recv()
        before = usmipc.stats()
        t0 = time.perf_counter()
        tree = usmipc.open_shared(raw, device=dev)
        opened = time.perf_counter() - t0
        after = usmipc.stats()
        bad = 0
        for name, leaf in tree.items():
            t = torch.from_dlpack(leaf)
            if float(t[0]) != expect or float(t[-1]) != expect:
                bad += 1
        usmipc.close_shared(tree)  # drop every tensor, as engines do
        delta = {k: after[k] - before[k] for k in after}
        out.append((r, opened * 1e3, delta, bad))
        conn.send("done")
    conn.send(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=400)
    ap.add_argument("--mib", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    import torch
    import usmipc
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=consumer, args=(there, a.rounds))
    proc.start()
    n = a.mib * (1 << 20) // 2  # bf16
    state = {f"w{i}": torch.full((n,), 1.0, dtype=torch.bfloat16,
                                 device="cuda") for i in range(a.tensors)}
    torch.cuda.synchronize()
    segments = {s["address"] for s in torch.cuda.memory_snapshot()}
    total = a.tensors * a.mib
    print(f"{a.tensors} tensors of {a.mib} MiB ({total / 1024:.1f} GiB) in "
          f"{len(segments)} caching-allocator segments")
    bundle = usmipc.share(state)
    value = 1.0
    for r in range(a.rounds):
        for t in state.values():
            t.add_(1.0)
        value += 1.0
        torch.cuda.synchronize()
        here.send((bundle.to_bytes(), value))
        assert here.recv() == "done"
    results = here.recv()
    proc.join()
    failed = False
    for r, ms, d, bad in results:
        work = {k: v for k, v in d.items() if v}
        print(f"round {r}: open {ms:.2f} ms, driver/transport work {work or 0}"
              f", {bad} tensors with wrong values")
        if bad or (r > 0 and work):
            failed = True
    print("warm_open:", "FAILED" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
