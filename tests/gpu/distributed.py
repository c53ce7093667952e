"""usmipc.distributed on GPUs: one rank of a 2-rank job, its launcher, and
the in-process baseline. tests/gpu/distributed.sh runs every variant.

    python3 tests/gpu/distributed.py baseline --json F     (sees both GPUs)
    python3 tests/gpu/distributed.py launch --visible all|per-rank|same
        [--engine torch|mpi] --json F                          (starts 2 ranks)
    mpirun -n 2 ... python3 tests/gpu/distributed.py rank --engine mpi ...

Each rank (torch.distributed with NCCL for the engine's own traffic; with
--engine mpi, mpi4py moves the handles and NCCL only runs the reference
all-reduce) allocates 256 MiB of usmipc memory on its GPU (the kind
USMIPC_CUDA_IPC picks: fd or native), exchanges it, and:

  1. reads the peer's pattern through the mapping, writes into the peer's
     buffer and sees the peer's write into its own after a barrier;
  2. copies the peer's buffer into a local one and back (one rank at a
     time, on its own stream: a pull and a push through the mapping) and
     compares the bandwidths with in-process copies between the same GPUs
     made the same way (the baseline: cudaMemcpyAsync on the reading or
     writing GPU's stream, with CuPy; goal >= 0.97x);
  3. runs the all-reduce of examples/distributed_allreduce.py on the
     mappings (the sum of two 256 MiB buffers, each rank reducing its half
     from both) and checks it against torch.distributed.all_reduce (NCCL),
     both timed.

--visible: all (both ranks see both GPUs, rank r uses GPU r), per-rank
(CUDA_VISIBLE_DEVICES gives each rank only its GPU: the peer's GPU is hidden,
docs/distributed.md), same (both ranks on GPU 0: the 1-GPU variant). Each
rank appends one JSON line to --json; the exit status is non-zero when a
check fails (bandwidth below the goal is reported, not failed).
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
MIB = 256
ITERS = 20


def local_rank():
    for var in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                "MPI_LOCALRANKID", "SLURM_LOCALID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def choose_gpu(visible):
    """Sets CUDA_VISIBLE_DEVICES for per-rank visibility before anything
    initializes CUDA (usmipc and torch are imported after); returns the
    index of this rank's GPU in what it sees."""
    if visible == "per-rank":
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = seen.split(",") if seen else [str(i) for i in range(8)]
        os.environ["CUDA_VISIBLE_DEVICES"] = ids[local_rank()]
        return 0
    if visible == "same":
        return 0
    return local_rank()


def bandwidth(torch, dst, src, iters=ITERS):
    """GB/s of dst.copy_(src) on the current stream, timed with events."""
    for _ in range(3):
        dst.copy_(src)
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    stop.record()
    stop.synchronize()
    return iters * dst.numel() * dst.element_size() / \
        (start.elapsed_time(stop) * 1e-3) / 1e9


def cupy_copy_gbps(cupy, stream_gpu, dst, src, nbytes, iters=ITERS):
    """GB/s of cudaMemcpyAsync(dst, src) issued on a stream of stream_gpu
    (pointers of either GPU: unified addressing and peer access), so that
    stream_gpu's copy engine does the work, as for a mapping."""
    rt = cupy.cuda.runtime
    with cupy.cuda.Device(stream_gpu):
        stream = cupy.cuda.Stream(non_blocking=True)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        for _ in range(3):
            rt.memcpyAsync(dst, src, nbytes, rt.memcpyDefault, stream.ptr)
        start.record(stream)
        for _ in range(iters):
            rt.memcpyAsync(dst, src, nbytes, rt.memcpyDefault, stream.ptr)
        stop.record(stream)
        stop.synchronize()
        ms = cupy.cuda.get_elapsed_time(start, stop)
    return iters * nbytes / (ms * 1e-3) / 1e9


def baseline(args):
    """In-process copies between the GPUs this process sees: a pull (the
    reading GPU's stream copies from the other GPU into its own memory, as
    a rank copying out of its mapping does) and a push, each way."""
    import torch
    n = MIB << 20
    out = {"what": "baseline", "gpus": torch.cuda.device_count(),
           "name": torch.cuda.get_device_name(0)}
    a = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    out["same_gpu_gbps"] = bandwidth(torch, a, b)
    if torch.cuda.device_count() >= 2:
        c = torch.empty(n, dtype=torch.uint8, device="cuda:1")
        out["peer_access"] = torch.cuda.can_device_access_peer(0, 1)
        try:
            import cupy
            for d in (0, 1):
                with cupy.cuda.Device(d):
                    try:
                        cupy.cuda.runtime.deviceEnablePeerAccess(1 - d)
                    except cupy.cuda.runtime.CUDARuntimeError:
                        pass  # already enabled
            mem = {0: a.data_ptr(), 1: c.data_ptr()}
            for d in (0, 1):
                out[f"pull_gbps_{d}"] = cupy_copy_gbps(
                    cupy, d, mem[d], mem[1 - d], n)
                out[f"push_gbps_{d}"] = cupy_copy_gbps(
                    cupy, d, mem[1 - d], mem[d], n)
            out["baseline_by"] = "cudaMemcpyAsync on the reading GPU's stream"
        except ImportError:
            # torch runs a cross-device copy_ on the source GPU's stream:
            # a push by the other GPU, the best stand-in without CuPy.
            with torch.cuda.device(0):
                out["pull_gbps_0"] = bandwidth(torch, a, c)
            with torch.cuda.device(1):
                out["pull_gbps_1"] = bandwidth(torch, c, a)
            out["push_gbps_0"] = out["pull_gbps_1"]
            out["push_gbps_1"] = out["pull_gbps_0"]
            out["baseline_by"] = "torch copy_ (source GPU's stream)"
    print(json.dumps(out))
    with open(args.json, "a") as f:
        f.write(json.dumps(out) + "\n")
    return 0


class TorchEngine:
    def __init__(self, dist, backend):
        self.dist = dist
        dist.init_process_group(backend)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def exchange(self, mem, ordered):
        import usmipc.distributed
        return usmipc.distributed.exchange(mem, ordered=ordered)

    def barrier(self):
        self.dist.barrier()


class MPIEngine:
    def __init__(self, dist, backend):
        from mpi4py import MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        # NCCL for the reference all-reduce only: its rendezvous through
        # the rank 0 address MPI broadcasts.
        port = None
        if self.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = self.comm.bcast(port)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          RANK=str(self.rank), WORLD_SIZE=str(self.size))
        dist.init_process_group(backend)

    def exchange(self, mem, ordered):
        import usmipc.distributed
        return usmipc.distributed.exchange_mpi(mem, self.comm,
                                               ordered=ordered)

    def barrier(self):
        self.comm.Barrier()


def rank(args):
    gpu = choose_gpu(args.visible)
    import torch
    import torch.distributed as dist
    from torch.utils.dlpack import from_dlpack

    import usmipc
    import usmipc.distributed
    from usmipc.memory import MemoryUSMDevice
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from distributed_allreduce import allreduce

    torch.cuda.set_device(gpu)
    # NCCL refuses two ranks on one GPU ("invalid usage"): with both ranks
    # on GPU 0 the engine's own traffic and the reference all-reduce go
    # through gloo (which reduces CUDA tensors too).
    backend = "gloo" if args.visible == "same" else "nccl"
    eng = (TorchEngine if args.engine == "torch" else MPIEngine)(dist, backend)
    me, n = eng.rank, eng.size
    peer = (me + 1) % n
    out = {"what": "rank", "rank": me, "engine": args.engine,
           "visible": args.visible, "engine_backend": backend,
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
           "cuda_ipc": os.environ.get("USMIPC_CUDA_IPC", "fd"),
           "gpus_seen": torch.cuda.device_count(), "checks": {}}
    checks = out["checks"]

    def barrier():
        torch.cuda.synchronize()
        eng.barrier()

    nbytes = MIB << 20
    mem = MemoryUSMDevice(nbytes, device=f"cuda:gpu:{gpu}")
    mine = from_dlpack(mem).view(torch.int32)
    words = mine.numel()
    pattern = torch.arange(words, dtype=torch.int32, device=mine.device)
    mine.copy_(pattern * (me + 1))
    # Ordered by default (the mapping waits for the fill above through an
    # IPC event); where that fails (an event of a hidden GPU), say so and
    # exchange unordered after a host synchronize.
    t0 = time.perf_counter()
    try:
        ex = eng.exchange(mine, None)
        out["ordered_exchange"] = "ok"
    except usmipc.distributed.ExchangeError as e:
        out["ordered_exchange"] = str(e)
        torch.cuda.synchronize()
        eng.barrier()
        ex = eng.exchange(mine, False)
    out["exchange_ms"] = (time.perf_counter() - t0) * 1e3
    out["local_ranks"] = list(ex.local_ranks)
    out["reasons"] = {str(k): v for k, v in ex.reasons.items()}
    theirs = from_dlpack(ex[peer]).view(torch.int32)
    out["peer_device"] = str(theirs.device)

    # 1. the peer's data through the mapping, writes both ways
    checks["reads_peer"] = bool(torch.equal(theirs, pattern * (peer + 1)))
    barrier()
    theirs[me] = -1000 - me  # into the peer's buffer
    barrier()
    checks["peer_wrote_here"] = int(mine[peer].item()) == -1000 - peer
    mine.copy_(pattern * (me + 1))
    barrier()

    # 1b. Exchange.barrier(stream): the device keeps the order, the host
    # waits for nothing. Each rank's stream sleeps ~50 ms, then writes a new
    # value; the peer's stream, after the barrier, copies the value out of
    # the mapping. A host barrier without a synchronize would let the copy
    # run before the write (the value would be the old one).
    stream = torch.cuda.current_stream()
    for gen in (1, 2):
        torch.cuda._sleep(100_000_000)  # cycles: ~50 ms on an H200
        mine[0:1].fill_(7000 * gen + me)
        t = time.perf_counter()
        ex.barrier(stream)
        out[f"device_barrier_host_ms_{gen}"] = (time.perf_counter() - t) * 1e3
        got = theirs[0:1].clone()  # on this rank's stream, after the wait
        torch.cuda.synchronize()
        checks[f"device_barrier_orders_{gen}"] = int(got.item()) == 7000 * gen + peer
        barrier()
    mine.copy_(pattern * (me + 1))
    barrier()

    # 2. copies out of (pull) and into (push) the peer's buffer through the
    # mapping, on this rank's stream, one rank at a time
    local = torch.empty_like(mine)
    for turn in range(n):
        barrier()
        if turn == me:
            out["mapped_pull_gbps"] = bandwidth(torch, local, theirs)
            checks["copy_matches"] = bool(torch.equal(local, theirs))
            out["mapped_push_gbps"] = bandwidth(torch, theirs, local)
    barrier()
    del local

    # 3. the all-reduce on the mappings against NCCL's
    values = mine.view(torch.float32)
    ranks = [values if r == me else from_dlpack(ex[r]).view(torch.float32)
             for r in range(n)]
    floats = (pattern % 251).to(torch.float32)

    def fill():
        values.copy_(floats * (me + 1))

    times = []
    for _ in range(5):
        fill()
        barrier()
        t = time.perf_counter()
        allreduce(values, ranks, barrier)
        times.append(time.perf_counter() - t)
    result = values.clone()
    reference = torch.empty_like(values)
    nccl = []
    for _ in range(5):
        fill()
        reference.copy_(values)
        barrier()
        t = time.perf_counter()
        dist.all_reduce(reference)
        torch.cuda.synchronize()
        nccl.append(time.perf_counter() - t)
    checks["allreduce_matches_nccl"] = bool(torch.equal(result, reference))
    checks["allreduce_value"] = bool(torch.equal(
        result, floats * (n * (n + 1) // 2)))
    out["allreduce_ms"] = min(times) * 1e3
    out["nccl_allreduce_ms"] = min(nccl) * 1e3
    del ranks, theirs  # their DLPack capsules hold the mappings
    ex.close()
    out["ok"] = all(checks.values())
    print(json.dumps(out), flush=True)
    with open(args.json, "a") as f:
        f.write(json.dumps(out) + "\n")
    dist.destroy_process_group()
    return 0 if out["ok"] else 1


def launch(args):
    """Starts 2 ranks of this script as torchrun would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "rank", "--engine", "torch",
             "--visible", args.visible, "--json", args.json], env=env))
    deadline = time.monotonic() + 300
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            codes.append(124)
    return max(abs(c) for c in codes)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("baseline", "launch", "rank"))
    parser.add_argument("--engine", choices=("torch", "mpi"), default="torch")
    parser.add_argument("--visible", choices=("all", "per-rank", "same"),
                        default="all")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    return {"baseline": baseline, "launch": launch, "rank": rank}[args.what](
        args)


if __name__ == "__main__":
    sys.exit(main())
