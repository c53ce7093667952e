"""torch.multiprocessing with torch's own CUDA reductions against the same
with usmipc.torch installed, in one run (issue 24's speed criteria):

- one CUDA tensor (64 MiB), fresh (a new tensor in a new caching-allocator
  segment each round) and repeated (the same tensor after an in-place
  update); the 338-tensor Qwen2.5-1.5B state dict (bf16, 3.1 GB) put as one
  object, cold (its first send) and warm (again after an update, the
  receiver having dropped the last round's tensors).
- per round: the sender's ForkingPickler.dumps plus the receiver's
  ForkingPickler.loads (the pickling and the rebuild), and the end-to-end
  time of the same object through an mp.Queue (put() to get() returned and
  the receiver's stream synchronized), beside a bytes object of the same
  size as the pickled message through the same queue (the queue's floor).
- the data is checked every round (the receiver reads the round's value).

    python3 tests/gpu/torch_mp_bench.py --json OUT.json [--rounds 15]

--device host runs the same harness on the CPU over usmipc host memory
(with --small: 1 MiB tensors, a 10-tensor dict), to check the harness
itself where there is no GPU; its figures are not the comparison.

Each mode runs in a process of its own (spawn children), so that torch's
reductions are untouched in the torch run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))

MIB64 = 16 << 20  # float32 elements: 64 MiB


def _sync():
    import torch
    if os.environ.get("BENCH_DEVICE", "cuda") == "cuda":
        torch.cuda.synchronize()


def _alloc(shape, dtype, value):
    """A tensor of shape filled with value: on the GPU, or over usmipc host
    memory (--device host)."""
    import torch
    if os.environ.get("BENCH_DEVICE", "cuda") == "cuda":
        return torch.full(shape, value, dtype=dtype, device="cuda")
    import math
    import usmipc
    from usmipc.memory import MemoryUSMDevice
    n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    mem = MemoryUSMDevice(max(n, 1), device=usmipc.Device("host:cpu"))
    t = torch.from_dlpack(mem)[:n].view(dtype).view(shape)
    return t.fill_(value)


def _cuda_lib():
    import ctypes
    cuda = ctypes.CDLL("libcuda.so.1")

    class Handle(ctypes.Structure):
        _fields_ = [("reserved", ctypes.c_char * 64)]

    get = cuda.cuIpcGetMemHandle
    get.argtypes = [ctypes.POINTER(Handle), ctypes.c_uint64]
    opn = cuda.cuIpcOpenMemHandle_v2
    opn.argtypes = [ctypes.POINTER(ctypes.c_uint64), Handle, ctypes.c_uint]
    close = cuda.cuIpcCloseMemHandle
    close.argtypes = [ctypes.c_uint64]
    return ctypes, Handle, get, opn, close


def _raw_export(ptr):
    """The driver's own export of a fresh allocation (s, handle bytes)."""
    ctypes, Handle, get, _, _ = _cuda_lib()
    h = Handle()
    t0 = time.perf_counter()
    rc = get(ctypes.byref(h), ptr)
    t = time.perf_counter() - t0
    assert rc == 0, rc
    # All 64 bytes (reading the c_char field would stop at a NUL).
    return t, ctypes.string_at(ctypes.addressof(h), 64)


def _raw_open(raw):
    """The driver's own open (and close) of that handle here: s."""
    import torch
    torch.cuda.synchronize()  # the primary context current on this thread
    ctypes, Handle, _, opn, close = _cuda_lib()
    h = Handle.from_buffer_copy(raw)
    p = ctypes.c_uint64()
    t0 = time.perf_counter()
    rc = opn(ctypes.byref(p), h, 1)  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    t = time.perf_counter() - t0
    assert rc == 0, rc
    assert close(p.value) == 0
    return t


def _receiver(conn, q, out):
    import torch
    from multiprocessing.reduction import ForkingPickler
    if os.environ.get("BENCH_MODE") == "usmipc":
        import usmipc.torch
        usmipc.torch.install()
    cuda = os.environ.get("BENCH_DEVICE", "cuda") == "cuda"
    if cuda:
        torch.cuda.init()
    stream = torch.cuda.current_stream() if cuda else None
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            return
        if cmd == "rawopen":  # the driver's own open of a fresh handle
            raw = conn.recv_bytes()
            try:
                conn.send(_raw_open(raw))
            except Exception as e:  # the sender reports it, not a hang
                conn.send(repr(e))
            continue
        if cmd == "bytes":  # pickling + rebuild, timed here
            data = conn.recv_bytes()
            t0 = time.perf_counter()
            obj = ForkingPickler.loads(data)
            t1 = time.perf_counter()
        else:  # "queue": end to end
            obj = q.get()
            if stream is not None:
                stream.synchronize()
            t1 = time.monotonic()
            t0 = None
        if isinstance(obj, bytes):  # the floor
            value = None
        else:
            first = obj if torch.is_tensor(obj) else next(iter(obj.values()))
            value = float(first.view(-1)[0])
            del first
        out.send((t0 and t1 - t0, t1, value))
        del obj


def run_mode(mode, rounds, small):
    import multiprocessing
    import torch
    from multiprocessing.reduction import ForkingPickler
    os.environ["BENCH_MODE"] = mode
    numel = (1 << 18) if small else MIB64
    if mode == "usmipc":
        import usmipc.torch
        usmipc.torch.install()
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    out, child_out = ctx.Pipe()
    q = ctx.Queue()
    p = ctx.Process(target=_receiver, args=(child_conn, q, child_out))
    p.start()
    if os.environ.get("BENCH_DEVICE", "cuda") == "cuda":
        torch.cuda.init()
    results = {}
    # Where the sender's dumps goes (usmipc): the usmipc.stats() counters
    # that moved over each dumps, and a profile of the repeated tensor's.
    stats = None
    if mode == "usmipc":
        import usmipc
        stats = usmipc.stats
    moved_of: list = []
    prof = [None]

    def one(obj, value):
        """pickle + rebuild (ms), end to end (ms), the floor (ms)."""
        _sync()
        conn.send("bytes")
        before = stats() if stats else None
        if prof[0] is not None:
            prof[0].enable()
        t0 = time.perf_counter()
        data = ForkingPickler.dumps(obj)
        t1 = time.perf_counter()
        if prof[0] is not None:
            prof[0].disable()
        if stats:
            after = stats()
            moved_of.append({k: after[k] - before[k] for k in after
                             if after[k] != before[k]})
        conn.send_bytes(data)
        load_s, _, got = out.recv()
        assert got == value, (got, value)
        size = len(data)
        _sync()
        conn.send("queue")
        ta = time.monotonic()
        q.put(obj)
        _, tb, got = out.recv()
        assert got == value, (got, value)
        conn.send("queue")
        tc = time.monotonic()
        q.put(b"\0" * size)  # the queue's own cost for that many bytes
        _, td, _ = out.recv()
        return ((t1 - t0 + load_s) * 1e3, (tb - ta) * 1e3, (td - tc) * 1e3,
                size, (t1 - t0) * 1e3, load_s * 1e3)

    def record(name, samples):
        pick = [s[0] for s in samples]
        e2e = [s[1] for s in samples]
        floor = [s[2] for s in samples]
        results[name] = {
            "pickle_rebuild_ms": statistics.median(pick),
            "end_to_end_ms": statistics.median(e2e),
            "floor_ms": statistics.median(floor),
            "dumps_ms": statistics.median(s[4] for s in samples),
            "loads_ms": statistics.median(s[5] for s in samples),
            "message_bytes": samples[-1][3], "rounds": len(samples),
            "all_pickle_rebuild_ms": pick, "all_end_to_end_ms": e2e,
            "all_dumps_ms": [s[4] for s in samples]}
        if stats:  # the counters each dumps of the case moved
            results[name]["dumps_moved"] = moved_of[-len(samples):]

    # One tensor, fresh: each round a new 64 MiB tensor in a new segment
    # (the earlier ones stay alive, so no cached block fits).
    keep = []
    samples = []
    for r in range(rounds):
        x = _alloc((numel,), torch.float32, float(r))
        keep.append(x)
        samples.append(one(x, float(r)))
    record("tensor_fresh", samples)
    if os.environ.get("BENCH_DEVICE", "cuda") == "cuda":
        # The floor of a fresh tensor: the driver's own export and open of
        # a new segment of the same size (ctypes, ~0.2 us of its own), what
        # any reduction of a fresh CUDA tensor pays at least.
        floor = []
        for r in range(rounds):
            y = _alloc((numel,), torch.float32, float(r))
            keep.append(y)
            _sync()
            t_export, raw = _raw_export(y.untyped_storage().data_ptr())
            conn.send("rawopen")
            conn.send_bytes(raw)
            t_open = conn.recv()
            if isinstance(t_open, str):
                raise RuntimeError(f"the receiver's raw open: {t_open}")
            floor.append((t_export + t_open) * 1e3)
        results["tensor_fresh"]["driver_floor_ms"] = statistics.median(floor)
        results["tensor_fresh"]["all_driver_floor_ms"] = floor
    del keep, x
    if os.environ.get("BENCH_DEVICE", "cuda") == "cuda":
        torch.cuda.empty_cache()
    # One tensor, repeated: the same one after an in-place update.
    x = _alloc((numel,), torch.float32, 0.0)
    samples = []
    import cProfile
    import pstats
    for r in range(rounds + 1):
        x.fill_(float(r))
        samples.append(one(x, float(r)))
    record("tensor_repeated", samples[1:])
    if stats:
        # The profile, of dumps calls of their own after the timed rounds:
        # cProfile multiplies a dumps' time several times over, so no timed
        # round may run under it (before, every round after the first did,
        # and usmipc's repeated dumps read 0.166 ms against 0.028 ms).
        prof[0] = cProfile.Profile()
        for r in range(rounds + 1, 2 * rounds + 1):
            x.fill_(float(r))
            one(x, float(r))
        # Microseconds per dumps (pstats prints seconds to 3 decimals).
        rows = sorted(pstats.Stats(prof[0]).stats.items(),
                      key=lambda kv: -kv[1][3])[:18]
        lines = [f"{'calls':>6} {'own us':>8} {'total us':>9}  function"]
        for (file, line, name), (_, calls, own, total, _) in rows:
            lines.append(f"{calls / rounds:6.1f} {own / rounds * 1e6:8.1f} "
                         f"{total / rounds * 1e6:9.1f}  "
                         f"{os.path.basename(file)}:{line}({name})")
        results["tensor_repeated"]["dumps_profile"] = "\n".join(lines)
        prof[0] = None
    del x
    # The state dict: cold (round 0), warm (the rest).
    from bench_weights import SMALL_SPEC, qwen2_spec
    sd = {name: _alloc(shape, torch.bfloat16, 0.0)
          for name, shape in (SMALL_SPEC if small else qwen2_spec())}
    samples = []
    for r in range(rounds + 1):
        for t in sd.values():
            t.view(-1)[0] = r
        samples.append(one(sd, float(r)))
    record("state_dict_cold", samples[:1])
    record("state_dict_warm", samples[1:])
    conn.send("stop")
    p.join(60)
    if mode == "usmipc":
        import usmipc.torch
        results["stats"] = usmipc.torch.stats()
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json")
    ap.add_argument("--mode", choices=["torch", "usmipc"])
    ap.add_argument("--device", choices=["cuda", "host"], default="cuda")
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    os.environ["BENCH_DEVICE"] = a.device
    if a.mode:  # one mode, in this process
        json.dump(run_mode(a.mode, a.rounds, a.small), sys.stdout)
        return
    both = {}
    for mode in ("torch", "usmipc"):
        r = subprocess.run([sys.executable, __file__, "--mode", mode,
                            "--rounds", str(a.rounds), "--device", a.device]
                           + (["--small"] if a.small else []),
                           capture_output=True, text=True, timeout=500)
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            sys.exit(f"the {mode} run failed")
        both[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    import torch
    meta = {"torch": torch.__version__, "device": a.device,
            "gpu": torch.cuda.get_device_name() if a.device == "cuda"
            else None,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(sys.argv)}
    print(f"{'case':18} {'':6} {'torch':>9} {'usmipc':>9} {'ratio':>7}")
    for case in ("tensor_fresh", "tensor_repeated", "state_dict_cold",
                 "state_dict_warm"):
        for k, label in (("pickle_rebuild_ms", "pickle"),
                         ("dumps_ms", "dumps"), ("loads_ms", "loads"),
                         ("end_to_end_ms", "e2e"), ("floor_ms", "floor")):
            t, u = both["torch"][case][k], both["usmipc"][case][k]
            print(f"{case:18} {label:6} {t:9.3f} {u:9.3f} {u / t:7.3f}")
    if "driver_floor_ms" in both["usmipc"]["tensor_fresh"]:
        print("tensor_fresh: the driver's own export + open of a fresh "
              "segment of the same size (cuIpcGetMemHandle + "
              "cuIpcOpenMemHandle), ms: torch's run "
              f"{both['torch']['tensor_fresh']['driver_floor_ms']:.3f}, "
              f"usmipc's run "
              f"{both['usmipc']['tensor_fresh']['driver_floor_ms']:.3f}")
    for case in ("tensor_fresh", "tensor_repeated", "state_dict_warm"):
        u = both["usmipc"][case]
        print(f"usmipc {case} dumps, ms: "
              f"{[round(x, 3) for x in u['all_dumps_ms']]}; counters moved "
              f"per dumps: {u.get('dumps_moved')}")
    print("usmipc tensor_repeated dumps profiled (rounds 1-):\n"
          + "\n".join(both["usmipc"]["tensor_repeated"].get(
              "dumps_profile", "").splitlines()[:40]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, **both}, f, indent=1)


if __name__ == "__main__":
    main()
