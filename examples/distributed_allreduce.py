"""An all-reduce written on the mappings that usmipc.distributed gives.

    python examples/distributed_allreduce.py [--nprocs 2] [--device cpu|cuda]
    torchrun --nproc-per-node 2 examples/distributed_allreduce.py ...

Each rank of a torch.distributed job (gloo on the CPU, NCCL on GPUs) holds a
buffer of float32 in usmipc memory (host memory on the CPU; GPU memory of
the kind USMIPC_CUDA_IPC picks) and calls usmipc.distributed.exchange(),
which maps every other rank's buffer into it (on GPUs through peer access,
also for a GPU that CUDA_VISIBLE_DEVICES hides). The all-reduce is then
plain tensor arithmetic: each rank sums its own slice of every rank's buffer
into its own buffer (reading only), the ranks wait for each other, and each
copies the other slices from their owners. The result is checked against
torch.distributed.all_reduce, and both times are printed. Started without
torchrun, the script starts --nprocs ranks of itself.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.dlpack import from_dlpack

import usmipc
import usmipc.distributed
from usmipc.memory import MemoryUSMDevice


def launch(nprocs: int) -> int:
    """Starts nprocs ranks of this script as torchrun would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, *sys.argv], env=env))
    return max(abs(p.wait()) for p in procs)


def allreduce(mine: torch.Tensor, ranks: list[torch.Tensor],
              barrier: Callable[[], None]) -> None:
    """Sums every rank's buffer into mine, in place, on every rank: rank r
    reduces slice r (reading it from every rank) into its own buffer, then
    gathers the other slices from their owners."""
    me, n = dist.get_rank(), len(ranks)
    step = (mine.numel() + n - 1) // n
    bounds = [(k * step, min((k + 1) * step, mine.numel())) for k in range(n)]
    a, b = bounds[me]
    for r in range(n):
        if r != me:
            mine[a:b] += ranks[r][a:b]
    barrier()  # every slice is reduced
    for r in range(n):
        if r != me:
            a, b = bounds[r]
            mine[a:b].copy_(ranks[r][a:b])
    barrier()  # nobody reads a slice its owner reduces next time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mib", type=int, default=16,
                        help="size of each rank's buffer (default 16 MiB)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", help="append each rank's result here")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        return launch(args.nprocs)

    cuda = args.device == "cuda"
    if cuda:  # one GPU per rank, or all ranks on the GPUs this one sees
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) %
                              torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo")
    me, world = dist.get_rank(), dist.get_world_size()
    where = (f"cuda:gpu:{torch.cuda.current_device()}" if cuda
             else "host:cpu")
    mem = MemoryUSMDevice(args.mib << 20, device=where)
    mine = from_dlpack(mem).view(torch.float32)
    count = mine.numel()

    def fill() -> None:
        mine.copy_(torch.arange(count, dtype=torch.float32,
                                device=mine.device) % 251 * (me + 1))

    def barrier() -> None:
        if cuda:
            torch.cuda.synchronize()  # this rank's work is done ...
        dist.barrier()               # ... and every rank's

    fill()
    with usmipc.distributed.exchange(mine) as ex:
        apart = {r: why for r, why in ex.reasons.items()}
        if apart:
            print(f"rank {me}: not on this node: {apart}", file=sys.stderr)
            return 1
        ranks = [mine if r == me else from_dlpack(ex[r]).view(
            torch.float32) for r in range(world)]
        times = []
        for _ in range(args.iters):
            fill()
            barrier()
            t0 = time.perf_counter()
            allreduce(mine, ranks, barrier)
            times.append(time.perf_counter() - t0)
        expected = torch.arange(count, dtype=torch.float32,
                                device=mine.device) % 251
        expected *= world * (world + 1) // 2
        ok = bool(torch.equal(mine, expected))
        del ranks
    # torch.distributed's own all-reduce of the same data
    reference = mine.clone()
    nccl_times = []
    for _ in range(args.iters):
        fill()
        reference.copy_(mine)
        barrier()
        t0 = time.perf_counter()
        dist.all_reduce(reference)
        if cuda:
            torch.cuda.synchronize()
        nccl_times.append(time.perf_counter() - t0)
    ok = ok and bool(torch.equal(reference, expected))
    result: dict[str, Any] = {
        "rank": me, "world": world, "device": where, "mib": args.mib,
        "ok": ok, "usmipc_allreduce_ms": min(times) * 1e3,
        "torch_allreduce_ms": min(nccl_times) * 1e3,
        "backend": dist.get_backend(),
        "cuda_ipc": os.environ.get("USMIPC_CUDA_IPC", "fd") if cuda else None}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
