"""Where the time of usmipc.torch's pickling goes (issue 24's speed work):
the sender's ForkingPickler.dumps and a receiver process's loads of the
same object, each timed per call and profiled (cProfile, top functions by
own time), and the usmipc calls under them timed alone:

- share(storages, release=True) without and with a stream, to_bytes();
- open_shared(raw, stream=, to="torch", release_stream=) and dropping
  what it returned (the ticket going back).

    python3 tests/gpu/torch_mp_profile.py [--n 200] [--mode usmipc|torch]

Cases: one 64 MiB tensor sent again and again (repeated), and the
338-tensor Qwen2.5-1.5B state dict (warm). Prints medians in microseconds.
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))


def med_us(xs):
    return statistics.median(xs) * 1e6


def top(prof, n=22):
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    lines = s.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    return "\n".join(lines[start:start + n + 1])


def receiver(conn, mode):
    import torch
    from multiprocessing.reduction import ForkingPickler
    if mode == "usmipc":
        import usmipc.torch
        usmipc.torch.install()
        from usmipc import _usmipc
    torch.cuda.init()
    stream = torch.cuda.current_stream()
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            return
        what, blobs = cmd
        out = {}
        if what == "loads":
            loads, drops = [], []
            for b in blobs:
                t0 = time.perf_counter()
                obj = ForkingPickler.loads(b)
                t1 = time.perf_counter()
                del obj
                t2 = time.perf_counter()
                loads.append(t1 - t0)
                drops.append(t2 - t1)
            out = {"loads_us": med_us(loads), "drop_us": med_us(drops)}
        elif what == "profile":
            prof = cProfile.Profile()
            for b in blobs:
                prof.enable()
                obj = ForkingPickler.loads(b)
                del obj
                prof.disable()
            out = {"profile": top(prof)}
        elif what == "open":  # usmipc bundles' bytes, opened alone
            index = torch.cuda.current_device()
            rel = lambda: torch.cuda.current_stream(index)  # noqa: E731
            opens, drops, plain = [], [], []
            for i, b in enumerate(blobs):
                t0 = time.perf_counter()
                if i % 2 == 0:
                    leaves = _usmipc.open_shared(b, stream=stream, to="torch",
                                                 release_stream=rel)
                else:
                    leaves = _usmipc.open_shared(b, stream=stream)
                t1 = time.perf_counter()
                del leaves
                t2 = time.perf_counter()
                (opens if i % 2 == 0 else plain).append(t1 - t0)
                drops.append(t2 - t1)
            out = {"open_torch_us": med_us(opens),
                   "open_arrays_us": med_us(plain),
                   "drop_us": med_us(drops)}
        elif what == "rebuild":  # ways to make a tensor over a storage
            out = rebuild_ways(blobs)
        conn.send(out)


def rebuild_ways(n):
    """Medians (us) of the ways to make a (1536, 1536) bf16 CUDA tensor at
    an offset in a storage, as the receiver rebuilds each tensor: torch's
    own (empty(0).set_), a template's new_empty, and views of the storage's
    uint8 leaf (view(dtype).as_strided)."""
    import torch
    leaf = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    storage = leaf.untyped_storage()
    dev, dt = storage.device, torch.bfloat16
    size, stride, off = (1536, 1536), (1536, 1), 1024
    tmpl = torch.empty(0, dtype=dt, device=dev)
    ways = {
        "rebuild_empty_set_us": lambda: torch.empty(
            0, dtype=dt, device=dev).set_(storage, off, size, stride),
        "rebuild_new_empty_set_us": lambda: tmpl.new_empty(0).set_(
            storage, off, size, stride),
        "rebuild_view_as_strided_us": lambda: leaf.view(dt).as_strided(
            size, stride, off),
    }
    out = {}
    for name, fn in ways.items():
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = med_us(ts)
    return out


def case(name, obj, storages, n, conn, mode, quiet):
    import torch
    from multiprocessing.reduction import ForkingPickler
    res = {"case": name}
    dumps, blobs = [], []
    for i in range(n):
        for s in storages[:1]:
            torch.empty(0, dtype=torch.uint8, device="cuda").set_(s)[0] = i
        t0 = time.perf_counter()
        b = bytes(ForkingPickler.dumps(obj))
        dumps.append(time.perf_counter() - t0)
        blobs.append(b)
    res["dumps_us"] = med_us(dumps[1:])
    res["bytes"] = len(blobs[-1])
    conn.send(("loads", blobs))
    res.update(conn.recv())
    del blobs
    # cProfile of both sides.
    prof = cProfile.Profile()
    blobs = []
    for i in range(min(n, 100)):
        prof.enable()
        blobs.append(bytes(ForkingPickler.dumps(obj)))
        prof.disable()
    res["dumps_profile"] = top(prof)
    conn.send(("profile", blobs))
    res["loads_profile"] = conn.recv()["profile"]
    del blobs
    if mode == "usmipc":
        from usmipc import _usmipc
        stream = torch.cuda.current_stream()
        for label, kw in (("share_us", {}), ("share_stream_us",
                                              {"stream": stream})):
            ts, blobs = [], []
            for i in range(n):
                t0 = time.perf_counter()
                bundle = _usmipc.share(storages, release=True, **kw)
                t1 = time.perf_counter()
                raw = bundle.to_bytes()
                t2 = time.perf_counter()
                ts.append((t1 - t0, t2 - t1))
                blobs.append(raw)
                import usmipc.memory as m
                m._keep(bundle)
            res[label] = med_us([a for a, _ in ts])
            res["to_bytes_us"] = med_us([b for _, b in ts])
            if kw:
                conn.send(("open", blobs))
                res.update(conn.recv())
            del blobs
        ts = []
        for i in range(n):
            t0 = time.perf_counter()
            e = torch.cuda.Event()
            e.record()
            ts.append(time.perf_counter() - t0)
        res["torch_event_record_us"] = med_us(ts)
        conn.send(("rebuild", n))
        res.update(conn.recv())
    for k, v in res.items():
        if k.endswith("_profile"):
            if not quiet:
                print(f"--- {name} {k}\n{v}")
        else:
            print(f"{name} {k}: {v:.1f}" if isinstance(v, float)
                  else f"{name} {k}: {v}")
    sys.stdout.flush()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--mode", choices=["usmipc", "torch"], default="usmipc")
    ap.add_argument("--quiet", action="store_true", help="no profiles")
    a = ap.parse_args()
    import multiprocessing
    import torch
    if a.mode == "usmipc":
        import usmipc.torch
        usmipc.torch.install()
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    p = ctx.Process(target=receiver, args=(child, a.mode))
    p.start()
    torch.cuda.init()
    print(f"== mode {a.mode}, n {a.n}, torch {torch.__version__}")
    x = torch.zeros(16 << 20, device="cuda")
    case("tensor_repeated", x, [x.untyped_storage()], a.n, conn, a.mode,
         a.quiet)
    from bench_weights import qwen2_spec
    sd = {k: torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
          for k, shape in qwen2_spec()}
    case("state_dict_warm", sd, [t.untyped_storage() for t in sd.values()],
         max(a.n // 10, 12), conn, a.mode, a.quiet)
    conn.send("stop")
    p.join(30)


if __name__ == "__main__":
    main()
