"""What usmipc pays a torch tensor on the host, beside torch's own reads:
share() of N views of one usmipc host allocation against a Python loop
reading each tensor's is_cpu, dtype, shape, stride() and data_ptr() (the
per-tensor part of issue 23 item 2, without any allocation's cost), and
ForkingPickler.dumps of a 338-tensor state dict (one host allocation a
tensor) through usmipc.torch's reducers (issue 24's sender side).

    .venv/bin/python bench/bench_torch_reads.py [--label L] [--tensors N]

Prints one line of medians. Two builds compare by running each with
PYTHONPATH set to a staged package, alternated; under valgrind
--tool=callgrind the instruction counts of the same calls are exact where
the VM's clock is not.
"""
import argparse
import statistics
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="")
    ap.add_argument("--tensors", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=25)
    args = ap.parse_args()
    import torch
    import usmipc
    import usmipc.torch as ut
    from multiprocessing.reduction import ForkingPickler
    from usmipc.memory import MemoryUSMDevice
    host = usmipc.Device("host:cpu")

    n = args.tensors
    mem = MemoryUSMDevice(2 * 32 * n, device=host)
    base = torch.from_dlpack(mem).view(torch.bfloat16)
    state = {f"model.layers.{i // 10}.mlp.experts.{i % 10}.weight":
             base[i * 32:(i + 1) * 32].view(4, 8) for i in range(n)}

    def attrs():
        for t in state.values():
            t.is_cpu, t.dtype, t.shape, t.stride(), t.data_ptr()

    usmipc.share(state)
    a, s = [], []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        attrs()
        a.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        usmipc.share(state)
        s.append(time.perf_counter() - t0)
    a_us = statistics.median(a) / n * 1e6
    s_us = statistics.median(s) / n * 1e6

    ut.install()
    mems = [MemoryUSMDevice(128, device=host) for _ in range(338)]
    sd = {f"model.layers.{i}.mlp.weight":
          torch.from_dlpack(m).view(torch.bfloat16).view(8, 8)
          for i, m in enumerate(mems)}
    keep = [ForkingPickler.dumps(sd) for _ in range(3)]
    d = []
    for _ in range(2 * args.reps):
        t0 = time.perf_counter()
        keep.append(ForkingPickler.dumps(sd))
        d.append(time.perf_counter() - t0)
        if len(keep) > 8:
            keep.pop(0)  # its ticket comes back: bounded, as a loop's
    d_ms = statistics.median(d) * 1e3
    print(f"{args.label}: us a tensor: attrs {a_us:.3f}, share {s_us:.3f} "
          f"(above attrs {s_us - a_us:.3f}); dumps of 338 tensors "
          f"{d_ms:.3f} ms ({d_ms / 338 * 1e3:.2f} us a tensor)")


if __name__ == "__main__":
    main()
