"""usmipc pools as torch's CUDA allocator (usmipc.memory.use_torch_allocator)
on a real GPU.

Each case runs a fresh producer process: torch's allocator can be changed
only once per process, before its first CUDA allocation. The producer
allocates tensors under the usmipc allocator and shares them with a consumer
process it starts (IPCMemoryHandle(tensor).to_bytes(), then
IPCMemoryHandle.open and torch.from_dlpack there), which checks every byte.
The counters (usmipc.stats) show that 50 tensors cost the producer one
driver export per pool segment and the consumer one driver import per
segment, not one per tensor, and that sharing them again costs no driver
export or import and no descriptor; the same through one bundle
(usmipc.share of the state dict). Other cases: the stream rule (a block
freed while its stream still works is not handed to another stream),
10,000 allocations from 4 threads with nothing left over, torch initialized
first (refused with a clear error), and an allocation the GPU cannot hold.

Runs where torch and a CUDA device are present (tests/gpu/run.sh, also in
its quick mode); skips elsewhere. Each case prints one line of results.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

usmipc = pytest.importorskip("usmipc")
pytest.importorskip("torch")

try:
    usmipc.Device("cuda:gpu:0")
except Exception as exc:  # pragma: no cover - CPU machines
    pytestmark = pytest.mark.skip(reason=f"no CUDA device: {exc}")

# The consumer: one JSON request per line, {"raws": [hex], "sha": [hex]};
# answers {"ok": [bool], "stats": usmipc.stats()} (counted from its start).
CONSUMER = textwrap.dedent(r"""
    import hashlib, json, sys
    import torch, usmipc
    from usmipc.memory import IPCMemoryHandle
    dev = usmipc.Device("cuda:gpu:0")
    usmipc.reset_stats()
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        ok = []
        for raw, sha in zip(req["raws"], req["sha"]):
            m = IPCMemoryHandle.open(bytes.fromhex(raw), dev)  # host wait
            t = torch.from_dlpack(m)
            data = t.view(torch.uint8).cpu().numpy().tobytes()
            ok.append(hashlib.sha1(data).hexdigest() == sha)
            del t
            IPCMemoryHandle.close_mapping(m)
        print(json.dumps({"ok": ok, "stats": usmipc.stats()}), flush=True)
""")

# The same for bundles: {"bundle": hex, "sha": {key: hex}} -> the tree of
# usmipc.open_shared, each leaf read through torch.from_dlpack.
BUNDLE_CONSUMER = textwrap.dedent(r"""
    import hashlib, json, sys
    import torch, usmipc
    usmipc.reset_stats()
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        tree = usmipc.open_shared(bytes.fromhex(req["bundle"]))
        ok = []
        for key, sha in req["sha"].items():
            t = torch.from_dlpack(tree[key])
            data = t.contiguous().view(-1).view(torch.uint8).cpu().numpy()
            ok.append(hashlib.sha1(data.tobytes()).hexdigest() == sha)
            del t
        usmipc.close_shared(tree)
        print(json.dumps({"ok": ok, "stats": usmipc.stats()}), flush=True)
""")

# The producer's common part; each case appends its own code.
PRODUCER = textwrap.dedent(r"""
    import hashlib, json, subprocess, sys, threading
    import usmipc
    from usmipc.memory import (IPCMemoryHandle, torch_pool_info,
                               use_torch_allocator)

    def start_consumer(source=None):
        p = subprocess.Popen([sys.executable, "-c", source or CONSUMER],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        assert p.stdout.readline().strip() == "ready"
        return p

    def sha(t):
        return hashlib.sha1(
            t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
        ).hexdigest()

    def share(consumer, tensors):
        # Fresh handles each time, as a producer sharing again makes them.
        raws = [IPCMemoryHandle(t).to_bytes().hex() for t in tensors]
        consumer.stdin.write(json.dumps(
            {"raws": raws, "sha": [sha(t) for t in tensors]}) + "\n")
        consumer.stdin.flush()
        reply = json.loads(consumer.stdout.readline())
        assert all(reply["ok"]), reply["ok"]
        return reply["stats"]

    def delta(after, before):
        return {k: after[k] - before[k] for k in after}

    def result(**kw):
        print("RESULT " + json.dumps(kw), flush=True)

    def is_block(t):
        # The tensor's memory is a usmipc pool block of its own.
        q = usmipc._usmipc._pointer_query(t.data_ptr())
        return q["base"] == t.data_ptr() and q["size"] == \
            (t.untyped_storage().nbytes() + 511) // 512 * 512
""")

CASES = {}

CASES["sizes"] = r"""
use_torch_allocator()
import torch
g = torch.Generator(device="cuda").manual_seed(1)
sizes = [1, 511, 512, 4096, (1 << 20) + 3, 65 << 20]  # the last: a segment
tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda",
                         generator=g) for n in sizes]
tensors.append(torch.randn(3, 5, 7, device="cuda", dtype=torch.float16))
tensors.append(torch.arange(1000, device="cuda", dtype=torch.float64))
empty = torch.empty(0, device="cuda")
assert all(t.data_ptr() % 512 == 0 for t in tensors)
assert all(is_block(t) for t in tensors)
consumer = start_consumer()
share(consumer, tensors)
share(consumer, tensors[::-1])
view = tensors[5][1000:3000]  # an interior view shares as its range
share(consumer, [view])
consumer.stdin.close()
assert consumer.wait(60) == 0
result(empty_data_ptr=empty.data_ptr(), pool=torch_pool_info(0))
"""

CASES["model"] = r"""
use_torch_allocator()
import torch
torch.manual_seed(0)
# A model-like state dict of 50 tensors, about 100 MiB.
model = {}
for i in range(25):
    rows = 256 * (1 + i % 8)
    model[f"layer{i}.weight"] = torch.randn(rows, 1024, device="cuda",
                                            dtype=torch.float16)
    model[f"layer{i}.bias"] = torch.randn(rows, device="cuda")
torch.cuda.synchronize()
assert len(model) == 50 and all(is_block(t) for t in model.values())
pool = torch_pool_info(0)
tensors = list(model.values())
consumer = start_consumer()
usmipc.reset_stats()
mine = [usmipc.stats()]
theirs = [dict.fromkeys(mine[0], 0)]
for _ in range(2):
    theirs.append(share(consumer, tensors))
    mine.append(usmipc.stats())
consumer.stdin.close()
assert consumer.wait(60) == 0
p1, p2 = delta(mine[1], mine[0]), delta(mine[2], mine[1])
c1, c2 = delta(theirs[1], theirs[0]), delta(theirs[2], theirs[1])
segs = pool["segments"]
result(segments=segs, segment_bytes=pool["segment_bytes"],
       blocks=pool["blocks"], producer_round1=p1, producer_round2=p2,
       consumer_round1=c1, consumer_round2=c2)
# One driver export (and at most one descriptor) per segment, not per
# tensor; the consumer one driver import per segment; nothing the 2nd time.
assert 1 <= p1["driver_exports"] <= segs < 50, (p1, segs)
assert p1["descriptors_sent"] <= segs, p1
assert 1 <= c1["driver_imports"] <= segs, (c1, segs)
assert c1["descriptors_received"] <= segs, c1
assert p2["driver_exports"] == 0 and p2["descriptors_sent"] == 0, p2
assert c2["driver_imports"] == 0 and c2["descriptors_received"] == 0, c2
"""

CASES["bundle"] = r"""
use_torch_allocator()
import torch
torch.manual_seed(0)
model = {f"layer{i}.weight": torch.randn(256 * (1 + i % 8), 1024,
                                         device="cuda", dtype=torch.float16)
         for i in range(50)}
torch.cuda.synchronize()
pool = torch_pool_info(0)
consumer = start_consumer(BUNDLE_CONSUMER)
usmipc.reset_stats()
mine = [usmipc.stats()]
theirs = [dict.fromkeys(mine[0], 0)]
shas = {k: sha(t) for k, t in model.items()}
for _ in range(2):
    b = usmipc.share(model)  # a fresh bundle each round
    consumer.stdin.write(json.dumps({"bundle": b.to_bytes().hex(),
                                     "sha": shas}) + "\n")
    consumer.stdin.flush()
    reply = json.loads(consumer.stdout.readline())
    assert all(reply["ok"]), reply["ok"]
    theirs.append(reply["stats"])
    mine.append(usmipc.stats())
consumer.stdin.close()
assert consumer.wait(60) == 0
p1, p2 = delta(mine[1], mine[0]), delta(mine[2], mine[1])
c1, c2 = delta(theirs[1], theirs[0]), delta(theirs[2], theirs[1])
segs = pool["segments"]
result(segments=segs, producer_round1=p1, producer_round2=p2,
       consumer_round1=c1, consumer_round2=c2)
assert 1 <= p1["driver_exports"] <= segs, (p1, segs)
assert 1 <= c1["driver_imports"] <= segs, (c1, segs)
assert c1["descriptors_received"] <= segs, c1
assert p2["driver_exports"] == 0 and p2["descriptors_sent"] == 0, p2
assert c2["driver_imports"] == 0 and c2["descriptors_received"] == 0, c2
"""

CASES["stream_rule"] = r"""
use_torch_allocator()
import torch
N = 1 << 24  # 64 MiB of float32
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
cycles = int(torch.cuda.get_device_properties(0).clock_rate * 300) \
    if hasattr(torch.cuda.get_device_properties(0), "clock_rate") \
    else int(1980000 * 300)
with torch.cuda.stream(s1):
    a = torch.full((N,), 1.0, device="cuda")
    torch.cuda._sleep(cycles)  # ~300 ms
    total = a.sum()            # reads a after the sleep
freed = a.data_ptr()
import time
t0 = time.perf_counter()
del a  # its stream still sleeps: the block must not go to s2
free_s = time.perf_counter() - t0
with torch.cuda.stream(s2):
    b = torch.full((N,), 5.0, device="cuda")
busy = not s1.query()  # s1 still sleeping when b got its block
reused_early = b.data_ptr() == freed and busy
torch.cuda.synchronize()
value = total.item()
del b
pool = torch_pool_info(0)  # waits for the pending frees
c = torch.empty(N, device="cuda")
result(sum=value, expected=float(N), reused_while_busy=reused_early,
       s1_busy_at_reuse=busy, free_seconds=round(free_s, 4),
       reused_after=c.data_ptr() == freed, pool=pool)
assert value == float(N), value
assert not reused_early
"""

CASES["churn"] = r"""
use_torch_allocator()
import torch
torch.cuda.synchronize()
base = torch_pool_info(0)
errors = []

def work(seed):
    try:
        gen = torch.Generator().manual_seed(seed)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            keep = []
            for i in range(2500):
                n = int(torch.randint(1, 300_000, (1,), generator=gen))
                x = torch.full((n,), float(i % 7), device="cuda")
                y = x * 2 + 1
                keep.append(y)
                if len(keep) > 8:
                    keep.pop(0)
                if i % 500 == 0 and float(y[-1]) != (i % 7) * 2 + 1:
                    errors.append((seed, i))
            s.synchronize()
    except Exception as e:  # reported below
        errors.append(repr(e))

threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
torch.cuda.synchronize()
after = torch_pool_info(0)
result(errors=errors, before=base, after=after)
assert not errors, errors
assert after["blocks"] == base["blocks"], (base, after)
assert after["segments"] <= 4, after
"""

CASES["after_init"] = r"""
import torch
x = torch.zeros(1, device="cuda")  # torch's own allocator, initialized
try:
    use_torch_allocator()
    result(raised=None)
except RuntimeError as e:
    result(raised=str(e))
"""

CASES["too_big"] = r"""
use_torch_allocator()
import torch
ok = torch.ones(10, device="cuda")
try:
    x = torch.empty(1 << 45, dtype=torch.uint8, device="cuda")  # 32 TiB
    outcome = {"data_ptr": x.data_ptr(),
               "last_error": usmipc.memory.torch_last_error()}
    del x  # never touched: its data pointer is what the allocator gave
except Exception as e:
    outcome = {"raised": type(e).__name__, "message": str(e)[:300]}
y = torch.ones(10, device="cuda")
result(outcome=outcome, still_works=float((ok + y).sum()))
"""


def run_case(name, kind=None, timeout=300):
    """Runs CASES[name] in a fresh producer process; kind (fd or native)
    sets USMIPC_CUDA_IPC, how the pool's segments are allocated and
    shared (docs/cuda.md). Returns the case's RESULT dict."""
    code = (f"CONSUMER = {CONSUMER!r}\nBUNDLE_CONSUMER = {BUNDLE_CONSUMER!r}\n"
            + PRODUCER + textwrap.dedent(CASES[name]))
    env = dict(os.environ)
    if kind is not None:
        env["USMIPC_CUDA_IPC"] = kind
    p = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=timeout, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(lines[-1][7:]) if lines else None
    print(f"\n{name}{f' ({kind})' if kind else ''}: {res}")
    assert p.returncode == 0, p.stderr[-4000:] + p.stdout[-2000:]
    return res


@pytest.mark.parametrize("kind", ["fd", "native"])
def test_sizes_share_and_read_back(kind):
    res = run_case("sizes", kind)
    assert res["empty_data_ptr"] == 0  # size 0: NULL, as torch's allocator
    assert res["pool"]["segments"] >= 2  # the 65 MiB tensor has its own


@pytest.mark.parametrize("kind", ["fd", "native"])
def test_model_shares_per_segment_not_per_tensor(kind):
    res = run_case("model", kind)
    assert res["segments"] < 50 and res["blocks"] >= 50


def test_model_in_one_bundle():
    """usmipc.share(state_dict) of tensors the allocator made: each pool
    segment named once; a second bundle of the same tensors costs no driver
    export or import and no descriptor."""
    res = run_case("bundle")
    assert res["consumer_round2"]["driver_imports"] == 0


def test_block_not_reused_while_its_stream_works():
    res = run_case("stream_rule")
    assert res["sum"] == res["expected"]
    assert not res["reused_while_busy"]


def test_threads_leave_no_block():
    res = run_case("churn")
    assert res["after"]["blocks"] == res["before"]["blocks"]


def test_refused_after_torch_initialized_cuda():
    res = run_case("after_init")
    assert res["raised"] and "before torch initializes CUDA" in res["raised"]


def test_allocation_the_gpu_cannot_hold():
    """torch does not check a pluggable allocator's NULL (docs/pools.md):
    the allocation either raises or gives a tensor whose data_ptr() is 0,
    and the reason is in the thread's last usmipc error. Either way the
    process goes on allocating."""
    res = run_case("too_big")
    out = res["outcome"]
    if "raised" in out:
        assert "usmipc" in out["message"] or "memory" in out["message"].lower()
    else:
        assert out["data_ptr"] == 0, out
        assert "usmipc_torch_malloc(35184372088832 bytes, cuda device 0)" \
            in out["last_error"], out
    assert res["still_works"] == 20.0
