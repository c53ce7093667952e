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


def _receiver(conn, q, out):
    import torch
    from multiprocessing.reduction import ForkingPickler
    if os.environ.get("BENCH_MODE") == "usmipc":
        import usmipc.torch
        usmipc.torch.install()
    torch.cuda.init()
    stream = torch.cuda.current_stream()
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            return
        if cmd == "bytes":  # pickling + rebuild, timed here
            data = conn.recv_bytes()
            t0 = time.perf_counter()
            obj = ForkingPickler.loads(data)
            t1 = time.perf_counter()
        else:  # "queue": end to end
            obj = q.get()
            stream.synchronize()
            t1 = time.monotonic()
            t0 = None
        first = obj if torch.is_tensor(obj) else next(iter(obj.values()))
        value = float(first.view(-1)[0])
        out.send((t0 and t1 - t0, t1, value))
        del obj, first


def run_mode(mode, rounds):
    import multiprocessing
    import torch
    from multiprocessing.reduction import ForkingPickler
    os.environ["BENCH_MODE"] = mode
    if mode == "usmipc":
        import usmipc.torch
        usmipc.torch.install()
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    out, child_out = ctx.Pipe()
    q = ctx.Queue()
    p = ctx.Process(target=_receiver, args=(child_conn, q, child_out))
    p.start()
    torch.cuda.init()
    results = {}

    def one(obj, value):
        """pickle + rebuild (ms), end to end (ms), the floor (ms)."""
        torch.cuda.synchronize()
        conn.send("bytes")
        t0 = time.perf_counter()
        data = ForkingPickler.dumps(obj)
        t1 = time.perf_counter()
        conn.send_bytes(data)
        load_s, _, got = out.recv()
        assert got == value, (got, value)
        size = len(data)
        torch.cuda.synchronize()
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
                size)

    def record(name, samples):
        pick = [s[0] for s in samples]
        e2e = [s[1] for s in samples]
        floor = [s[2] for s in samples]
        results[name] = {
            "pickle_rebuild_ms": statistics.median(pick),
            "end_to_end_ms": statistics.median(e2e),
            "floor_ms": statistics.median(floor),
            "message_bytes": samples[-1][3], "rounds": len(samples),
            "all_pickle_rebuild_ms": pick, "all_end_to_end_ms": e2e}

    # One tensor, fresh: each round a new 64 MiB tensor in a new segment
    # (the earlier ones stay alive, so no cached block fits).
    keep = []
    samples = []
    for r in range(rounds):
        x = torch.full((MIB64,), float(r), device="cuda")
        keep.append(x)
        samples.append(one(x, float(r)))
    record("tensor_fresh", samples)
    del keep, x
    torch.cuda.empty_cache()
    # One tensor, repeated: the same one after an in-place update.
    x = torch.zeros(MIB64, device="cuda")
    samples = []
    for r in range(rounds + 1):
        x.fill_(float(r))
        samples.append(one(x, float(r)))
    record("tensor_repeated", samples[1:])
    del x
    # The state dict: cold (round 0), warm (the rest).
    from bench_weights import qwen2_spec
    sd = {name: torch.empty(shape, dtype=torch.bfloat16, device="cuda")
          for name, shape in qwen2_spec()}
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
    a = ap.parse_args()
    if a.mode:  # one mode, in this process
        json.dump(run_mode(a.mode, a.rounds), sys.stdout)
        return
    both = {}
    for mode in ("torch", "usmipc"):
        r = subprocess.run([sys.executable, __file__, "--mode", mode,
                            "--rounds", str(a.rounds)],
                           capture_output=True, text=True, timeout=500)
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            sys.exit(f"the {mode} run failed")
        both[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    import torch
    meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(sys.argv)}
    print(f"{'case':18} {'':6} {'torch':>9} {'usmipc':>9} {'ratio':>7}")
    for case in ("tensor_fresh", "tensor_repeated", "state_dict_cold",
                 "state_dict_warm"):
        for k, label in (("pickle_rebuild_ms", "pickle"),
                         ("end_to_end_ms", "e2e"), ("floor_ms", "floor")):
            t, u = both["torch"][case][k], both["usmipc"][case][k]
            print(f"{case:18} {label:6} {t:9.3f} {u:9.3f} {u / t:7.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, **both}, f, indent=1)


if __name__ == "__main__":
    main()
