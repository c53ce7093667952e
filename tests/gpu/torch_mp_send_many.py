"""PyTorch's test_cuda_send_many, checked item by item: a sender puts
`count` fresh 5-element CUDA tensors (deleting each right after put), a
middle process puts a clone of each on a second queue (--hops 3, as the
test) or the last process reads the sender's directly (--hops 2), and the
last process checks that tensor i holds i in every element. Prints the
first mismatches and their count, so that a wrong sum says which items and
how (a stale value, a later one, a zero).

    USMIPC_TORCH=1 python3 tests/gpu/torch_mp_send_many.py [--count 100000]
        [--hops 3]
"""
import argparse
import sys
import time

import torch
import torch.multiprocessing as mp


def sender(q, done, count):
    for i in range(count):
        t = torch.full([5], i, device="cuda", dtype=torch.long)
        q.put(t)
        del t
    done.wait()


def middle(q_in, q_out, done, count):
    for _ in range(count):
        t = q_in.get()
        q_out.put(t.clone())
    done.wait()


def checker(q, out, done, count):
    bad = []
    nbad = 0
    for i in range(count):
        t = q.get()
        got = t.tolist()
        if got != [i] * 5:
            nbad += 1
            if len(bad) < 20:
                bad.append((i, got))
    out.put((nbad, bad))
    done.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=100000)
    ap.add_argument("--hops", type=int, choices=[2, 3], default=3)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q1, q2, q3 = ctx.Queue(), ctx.Queue(), ctx.Queue()
    done = ctx.Event()
    procs = [ctx.Process(target=sender, args=(q1, done, a.count))]
    if a.hops == 3:
        procs.append(ctx.Process(target=middle, args=(q1, q2, done, a.count)))
        procs.append(ctx.Process(target=checker, args=(q2, q3, done,
                                                       a.count)))
    else:
        procs.append(ctx.Process(target=checker, args=(q1, q3, done,
                                                       a.count)))
    t0 = time.monotonic()
    for p in procs:
        p.start()
    nbad, bad = q3.get()
    dt = time.monotonic() - t0
    done.set()
    for p in procs:
        p.join(30)
    print(f"send_many hops={a.hops} count={a.count}: {nbad} wrong "
          f"({dt:.1f} s, {dt / a.count * 1e6:.0f} us an item); first: {bad}")
    sys.exit(1 if nbad else 0)


if __name__ == "__main__":
    main()
