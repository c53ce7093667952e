"""System calls of a consumer's warm opens (issue 23, item 1): a producer
keeps a bundle of a model's state dict (caching-allocator tensors on the
GPU; on the host, views of one usmipc host allocation each) and sends the
same bytes every round; a consumer process opens them with a stream,
synchronizes, releases and drops the tree, as engines do. After two warm-up
rounds `strace -c -f -p <consumer>` is attached for the timed rounds only.
The target: the count per warm open does not grow from the 338-tensor to
the 4,719-tensor layout, and usmipc.stats() shows no driver import or
query, no descriptor and no broker request in them.

    python3 tests/gpu/warm_open_strace.py [--layout qwen|moe|small]
        [--device cuda|host] [--rounds 20] [--out strace.txt]

Prints the consumer's system calls per round, and apart those of the open
itself: each round is a whole handoff on the consumer's side, the
harness's pipe (the bytes in, "done" out: reads, a write, a poll), the
open, and the release ticket's return, which is one round trip to the
producer's broker a handoff (a sendto and a recvmsg; transport_exchanges
1), not one an allocation. The pipe's calls grow with the bytes (a read
per 64 KiB: the MoE's bundle is several), so the open's count leaves out
every call on the pipe's descriptor, and those of the consumer's other
threads (a timer's futex waits, by the clock and not by the opens) (run 83 counted them: 7.0 calls a
round for qwen, 10.1 for the MoE, of which reads 2.0 and 4.9). strace must be on PATH
(carry a static one to a machine that lacks it).

On the 2-vCPU VM (host memory, one allocation a tensor): small (10
tensors) 6.8 calls an open, qwen (338) 7.7 (the extra a thread's start
seen once in 10 rounds); counters: transport_exchanges 1 an open, nothing
else.
"""
import argparse
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "bench"))


def consumer(conn, kind):
    import usmipc
    stream = None
    if kind == "cuda":
        import torch
        torch.cuda.init()
        stream = torch.cuda.Stream()
    conn.send((os.getpid(), conn.fileno()))
    before = None
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg == "mark":
            before = usmipc.stats()
            conn.send("marked")
            continue
        tree = usmipc.open_shared(msg, stream=stream)
        if stream is not None:
            stream.synchronize()
        usmipc.release_shared(tree, stream=stream)
        usmipc.close_shared(tree)
        del tree
        conn.send("done")
    after = usmipc.stats()
    conn.send({k: after[k] - before[k] for k in after
               if isinstance(after[k], int) and after[k] != before[k]})


def make_state(spec, kind):
    import math
    import torch
    import usmipc
    if kind == "cuda":
        return {n: torch.empty(s, dtype=torch.bfloat16, device="cuda")
                for n, s in spec}, []
    from usmipc.memory import MemoryUSMDevice
    state, mems = {}, []
    for name, shape in spec:
        mem = MemoryUSMDevice(2 * math.prod(shape),
                              device=usmipc.Device("host:cpu"))
        mems.append(mem)
        state[name] = torch.from_dlpack(mem).view(torch.bfloat16).view(shape)
    return state, mems


def summary(path, rounds, pid, harness_fd):
    """strace's lines counted by call, divided by rounds: (every call; the
    opening thread's calls not on the harness's pipe; other threads'),
    each [(calls per round, name)]."""
    import collections
    import re
    call = re.compile(r"^(\d+)\s+([a-z_0-9]+)\((.*)")
    on_pipe = re.compile(r"^%d[,)]|\{fd=%d," % (harness_fd, harness_fd))
    every, opens, others = (collections.Counter() for _ in range(3))
    for line in open(path):
        m = call.match(line)
        if m is None:  # "<... resumed>", "+++ exited", signals
            continue
        tid, name, args = int(m.group(1)), m.group(2), m.group(3)
        every[name] += 1
        if tid != pid:
            others[name] += 1
        elif not on_pipe.search(args):
            opens[name] += 1
    return tuple(sorted(((c / rounds, n) for n, c in counts.items()),
                        reverse=True) for counts in (every, opens, others))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", choices=("qwen", "moe", "small"),
                    default="qwen")
    ap.add_argument("--device", choices=("cuda", "host"), default="cuda")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default="warm_open_strace.txt")
    a = ap.parse_args()
    if shutil.which("strace") is None:
        sys.exit("strace is not on PATH: install or carry it")
    import usmipc
    from bench_weights import SMALL_SPEC, moe_spec, qwen2_spec
    spec = {"qwen": qwen2_spec, "moe": moe_spec,
            "small": lambda: SMALL_SPEC}[a.layout]()
    state, _mems = make_state(spec, a.device)
    stream = None
    if a.device == "cuda":
        import torch
        stream = torch.cuda.current_stream()
        torch.cuda.synchronize()
    kept = usmipc.share(state, stream=stream, release=True)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=consumer, args=(there, a.device))
    proc.start()
    pid, harness_fd = here.recv()

    def handoff():
        here.send(kept.to_bytes())
        here.recv()

    for _ in range(2):  # the cold open, then one warm
        handoff()
    here.send("mark")
    here.recv()
    tracer = subprocess.Popen(["strace", "-f", "-qq", "-o", a.out, "-p",
                               str(pid)], stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached
    for _ in range(a.rounds):
        handoff()
    time.sleep(0.2)
    tracer.send_signal(2)
    tracer.wait()
    here.send(None)
    moved = here.recv()
    proc.join()
    every, opens, others = summary(a.out, a.rounds, pid, harness_fd)
    for what, rows in (("round, every thread and the harness's pipe", every),
                       ("warm open, its thread without the pipe", opens),
                       ("round in other threads (timers: not per open)",
                        others)):
        print(f"{a.layout} ({len(state)} tensors), {a.device}: "
              f"{sum(c for c, _ in rows):.1f} system calls per {what}, "
              f"{a.rounds} rounds: " + ", ".join(
                  f"{name} {c:.1f}" for c, name in rows))
    print(f"counters moved in the {a.rounds} warm opens: {moved}")


if __name__ == "__main__":
    main()
