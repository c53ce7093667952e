"""The consumer's update in one call, on the GPU: a producer keeps one bundle
of a state dict (PyTorch's caching allocator, or expandable segments with
--expandable) and hands its bytes over every round after an in-place
update; a consumer process copies them into its own weights with
usmipc.UpdatePlan.update(raw, stream) and synchronizes. Every round checks
a float64 sum of every destination tensor against the producer's.

The round (update_round_ms, loop_round_ms) is the issue's "update": from the
producer's to_bytes() to the consumer's stream synchronized, the bytes sent
through a Pipe. (Until run 46 it also held the consumer's zeroing of its
weights, 4,719 fills for the MoE: the zeroing now follows the checks.) Side by side in the consumer, on the same bytes:
  - flat:     one device copy of the same total bytes (the floor);
  - update:   UpdatePlan.update + synchronize (host time of the call too);
  - loop:     open_shared(to="torch") + a copy_ per tensor + close (the way
              engines do it without the plan);
  - flat_idle: the flat copy timed as the update is, the consumer woken by
              the Pipe first (an idle GPU and CPU start slower than the
              back-to-back copies of flat);
  - gpu:      the device's time alone of the update and of the flat copy:
              the stream spins about 2 ms first (torch.cuda._sleep), which
              hides the call's host work before its launch, and two events
              time what follows (update_gpu_ms, flat_gpu_ms).

  python3 tests/gpu/update_bench.py --layout moe|qwen [--rounds 6]
      [--expandable] [--late-release] [--json out.json]

Exits 1 when a round's data is wrong or a warm update did driver work.
"""
import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time


def qwen_spec():
    """Qwen2.5-1.5B's 338 tensors: bench/bench_weights.py's layout."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "bench"))
    from bench_weights import qwen2_spec
    return qwen2_spec()


def moe_spec(layers=12):
    """Qwen3-30B-A3B's layout, `layers` of its 48: 4,719 tensors at 12
    (bench/bench_weights.py's)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "bench"))
    from bench_weights import moe_spec as spec
    return spec(layers=layers)


def sums(tensors):
    import torch
    return torch.stack([t.sum(dtype=torch.float64) for t in tensors]).cpu()


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def consumer(conn, spec, late_release=False):
    import torch
    import usmipc
    torch.cuda.init()
    dev = torch.device("cuda:0")
    dest = {n: torch.empty(s, dtype=torch.bfloat16, device=dev)
            for n, s in spec}
    total = sum(t.numel() * 2 for t in dest.values())
    flat_src = torch.empty(total, dtype=torch.uint8, device=dev)
    flat_dst = torch.empty_like(flat_src)
    s = torch.cuda.Stream()
    plan = usmipc.UpdatePlan(dest)
    out = {"flat_ms": [], "update_ms": [], "update_call_ms": [],
           "release_call_ms": [], "loop_ms": [], "bad": 0, "warm_driver": [],
           "flat_idle_ms": [], "flat_gpu_ms": [], "update_gpu_ms": []}
    e0 = torch.cuda.Event(enable_timing=True)
    e1 = torch.cuda.Event(enable_timing=True)
    # A spin of the stream first (about 2 ms): the call's host work before
    # its launch is hidden behind it, so that the events time the device
    # work alone.
    spin_cycles = 4_000_000  # about 2 ms at 1.98 GHz
    while True:
        msg = conn.recv()
        if msg is None:
            break
        op, raw, expect = msg
        if op == "flat_idle":  # as the update: woken by the Pipe, timed
            t0 = time.perf_counter()
            with torch.cuda.stream(s):
                flat_dst.copy_(flat_src)
            s.synchronize()
            out["flat_idle_ms"].append((time.perf_counter() - t0) * 1e3)
            with torch.cuda.stream(s):
                torch.cuda._sleep(spin_cycles)
                e0.record(s)
                flat_dst.copy_(flat_src)
                e1.record(s)
            s.synchronize()
            out["flat_gpu_ms"].append(e0.elapsed_time(e1))
            conn.send("synced")
            conn.send("ok")
            continue
        if op == "flat":
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                flat_dst.copy_(flat_src)
                torch.cuda.synchronize()
                out["flat_ms"].append((time.perf_counter() - t0) * 1e3)
            conn.send("ok")
            continue
        before = usmipc.stats()
        t0 = time.perf_counter()
        if op == "update_gpu":  # the device's time alone
            with torch.cuda.stream(s):
                torch.cuda._sleep(spin_cycles)
            e0.record(s)
            plan.update(raw, stream=s, release=not late_release)
            e1.record(s)
            if late_release:
                usmipc.release_shared(raw, stream=s)
            t1 = time.perf_counter()
            s.synchronize()
        elif op == "update":
            plan.update(raw, stream=s, release=not late_release)
            t1 = time.perf_counter()
            if late_release:  # the ticket's return, timed apart
                usmipc.release_shared(raw, stream=s)
                out["release_call_ms"].append(
                    (time.perf_counter() - t1) * 1e3)
            s.synchronize()
        else:  # the loop engines write without a plan
            with torch.cuda.stream(s):
                tree = usmipc.open_shared(raw, stream=s, to="torch")
                for k, t in dest.items():
                    t.copy_(tree[k])
                usmipc.release_shared(raw, stream=s)
                del tree
            t1 = time.perf_counter()
            s.synchronize()
        t2 = time.perf_counter()
        conn.send("synced")  # the producer's round ends here; checks follow
        after = usmipc.stats()
        got = sums(list(dest.values()))
        if not torch.equal(got, expect):
            out["bad"] += 1
            print(f"consumer: {op}: {int((got != expect).sum())} tensors "
                  f"differ", flush=True)
        for t in dest.values():  # for the next round, off its clock
            t.zero_()
        torch.cuda.synchronize()
        if op == "update_gpu":
            out["update_gpu_ms"].append(e0.elapsed_time(e1))
        elif op == "update":
            out["update_ms"].append((t2 - t0) * 1e3)
            out["update_call_ms"].append((t1 - t0) * 1e3)
            out["warm_driver"].append(after["driver_imports"]
                                      - before["driver_imports"])
        else:
            out["loop_ms"].append((t2 - t0) * 1e3)
        conn.send("ok")
    conn.send(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="moe", choices=["moe", "qwen"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--expandable", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--late-release", action="store_true",
                    help="update(release=False), then release_shared() "
                         "timed apart: splits the call's host time")
    a = ap.parse_args()
    if a.expandable:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch
    import usmipc
    spec = moe_spec() if a.layout == "moe" else qwen_spec()
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=consumer, args=(there, spec, a.late_release))
    proc.start()
    dev = torch.device("cuda:0")
    state = {n: torch.empty(s, dtype=torch.bfloat16, device=dev)
             for n, s in spec}
    nbytes = sum(t.numel() * 2 for t in state.values())
    bundle = usmipc.share(state, release=True)
    here.send(("flat", None, None))
    assert here.recv() == "ok"
    rounds = []
    for r in range(a.rounds):
        for op in ("update", "loop", "update_gpu", "flat_idle"):
            if op == "flat_idle":
                here.send((op, None, None))
                assert here.poll(600) and here.recv() == "synced"
                assert here.poll(600) and here.recv() == "ok"
                continue
            for i, t in enumerate(state.values()):  # the in-place update
                t.copy_(torch.arange(t.numel(), device=dev).view(t.shape)
                        % 251 + (r + i) % 5)
            expect = sums(list(state.values()))
            bundle.wait_released(stream=torch.cuda.current_stream())
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            raw = bundle.to_bytes()
            here.send((op, raw, expect))
            assert here.poll(600), "the consumer did not answer"
            assert here.recv() == "synced"
            rounds.append((op, (time.perf_counter() - t0) * 1e3))
            assert here.poll(600) and here.recv() == "ok"
    here.send(None)
    out = here.recv()
    proc.join(60)
    upd = [ms for op, ms in rounds if op == "update"][1:]
    loop = [ms for op, ms in rounds if op == "loop"][1:]
    flat = med(out["flat_ms"])
    res = {
        "layout": a.layout, "tensors": len(spec), "bytes": nbytes,
        "allocator": "expandable" if a.expandable else "caching",
        "copy_batch": os.environ.get("USMIPC_COPY_BATCH", "kernel"),
        "chunk_kib": int(os.environ.get("USMIPC_COPY_CHUNK_KIB", "1024")),
        "flat_copy_ms": flat,
        "update_consumer_ms": med(out["update_ms"][1:]),
        "update_call_host_ms": med(out["update_call_ms"][1:]),
        # --late-release: the ticket returned by its own release_shared
        # after the call (its time here), not inside the update call.
        "late_release": a.late_release,
        "release_call_host_ms": (med(out["release_call_ms"][1:])
                                 if a.late_release else None),
        "update_round_ms": med(upd),
        "loop_consumer_ms": med(out["loop_ms"][1:]),
        "loop_round_ms": med(loop),
        "update_cold_ms": out["update_ms"][0],
        "warm_driver_imports": out["warm_driver"][1:],
        "bad_rounds": out["bad"],
    }
    res["flat_idle_ms"] = med(out["flat_idle_ms"][1:])
    res["flat_gpu_ms"] = med(out["flat_gpu_ms"][1:])
    res["update_gpu_ms"] = med(out["update_gpu_ms"][1:])
    res["update_over_flat_idle"] = (res["update_consumer_ms"]
                                    / res["flat_idle_ms"])
    res["update_gpu_over_flat_gpu"] = (res["update_gpu_ms"]
                                       / res["flat_gpu_ms"])
    res["update_over_flat"] = res["update_consumer_ms"] / flat
    res["host_us_per_leaf"] = res["update_call_host_ms"] * 1e3 / len(spec)
    print(json.dumps(res, indent=1), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    ok = out["bad"] == 0 and not any(out["warm_driver"][1:])
    print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
