"""usmipc.share() of memory another library allocated, per allocation, as
the number of allocations grows, under the driver of nothing
(bench/fakecuda: `make fakecuda`), where the driver's share is zero and
usmipc's own bookkeeping is all that is timed.

A caching allocator's model is hundreds of allocations (the MoE layout of
issue 23: 798): share() must cost the same per allocation at 127 as at
3,000. Each allocation is one leaf (an object with
__cuda_array_interface__ over cuMemAlloc memory); every share() is warm
(each allocation exported before and kept by earlier bundles, as a
weight-update loop keeps the last step's), medians of --reps calls.

    make fakecuda python
    LD_LIBRARY_PATH=build/fakecuda .venv/bin/python \\
        bench/bench_foreign_share.py [--counts 127 798 3000] [--reps 15]

It measures nothing about a GPU: the driver's own query and export are
measured beside usmipc on one (tests/gpu/per_tensor_bench.py).
"""
import argparse
import ctypes
import statistics
import time

import usmipc


class DeviceArray:
    """Half-precision device memory, described as CuPy describes it."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {
            "shape": (nbytes // 2,), "typestr": "<f2", "data": (ptr, False),
            "version": 3, "strides": None}


def allocate(cu, count, nbytes):
    out = {}
    for i in range(count):
        p = ctypes.c_uint64()
        rc = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(nbytes))
        if rc != 0:
            raise SystemExit(f"cuMemAlloc_v2 failed ({rc})")
        out[f"layer{i}.weight"] = DeviceArray(p.value, nbytes)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", type=int, nargs="+", default=[127, 798, 3000])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    cu = ctypes.CDLL("libcuda.so.1")  # fakecuda's: no context needed
    cu.cuInit(0)
    for count in args.counts:
        leaves = allocate(cu, count, 1 << 16)
        kept = [usmipc.share(leaves)]
        xs = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            kept.append(usmipc.share(leaves))
            xs.append(time.perf_counter() - t0)
            if len(kept) > 8:
                del kept[1:]
        print(f"{count} allocations: share() "
              f"{statistics.median(xs) / count * 1e6:.3f} us per allocation "
              f"(median of {args.reps})")


if __name__ == "__main__":
    main()
