"""Weight handoff (issue 11): a Qwen2.5-1.5B state dict in bf16 (338 tensors,
3.09 GB, the names and shapes of the checkpoint, random values made here)
handed from a producer process to a consumer process, side by side:

  usmipc       usmipc.share() of tensors from PyTorch's caching allocator;
               the consumer open_shared()s the bundle on its stream and calls
               torch.from_dlpack on every leaf
  usmipc-pool  the same, the tensors placed in blocks of one usmipc
               MemoryPool (capacity = the state dict: one segment)
  usmipc-exp   the same from PyTorch's expandable segments (switched on at
               run time for this method only)
  ... kept     (usmipc kept, usmipc-pool kept, usmipc-exp kept) the producer
               shares once per state dict and resends that bundle's
               to_bytes() on warm handoffs; the consumer's leaves are the
               SharedArrays open_shared returns (no torch tensor per leaf)
  ...>torch    the consumer asks open_shared(to="torch") for the leaves
  torch.mp     torch.multiprocessing: reduce_tensor per tensor, the consumer
               calls each rebuild (one legacy handle + one IPC event per
               tensor; opens cached per caching-allocator segment)
  flatten      the producer copies every tensor into one bf16 bucket
               (torch.cat, timed; cold: a new bucket, warm: out= the same
               bucket), synchronizes, sends one reduce_tensor and the names
               and shapes; the consumer rebuilds the bucket and splits it
               into views
  cuda.core    one IPC-enabled cuda.core memory pool, a buffer per tensor,
               Buffer.ipc_descriptor per buffer, the pool's allocation handle
               (an fd, through multiprocessing's reduction) on the cold
               handoff, Buffer.from_ipc_descriptor per buffer in the consumer

Both processes are warm before anything is timed: imports done, CUDA context
made, and a throwaway handoff of a tiny state dict made by the same method.
Time = from the producer's call (time.perf_counter_ns() just before
share/reduce/cat/export) to the consumer holding every tensor as a torch
tensor of the producer's shape and dtype, with its stream synchronized (so
any device-side wait for the producer's work is inside); the consumer takes
perf_counter_ns() then and sends it back over the pipe (perf_counter_ns is
CLOCK_MONOTONIC: one clock for both processes on Linux). Before every
handoff the producer's work on the tensors is finished (the fill or the
in-place update, then a device synchronize).

  cold  the first handoff of a freshly allocated state dict: per repetition
        the consumer has closed everything from the previous one, the
        producer has freed its previous tensors and called
        torch.cuda.ipc_collect() and torch.cuda.empty_cache(), so the
        caching allocator takes new segments from cudaMalloc (which may land
        at the same addresses: a new allocation all the same), usmipc pools
        and cuda.core pools are new, and every export and import is a first
        one. Cold includes whatever each method does once per buffer or
        pool: usmipc's driver export and import per segment, torch's
        cudaIpcGetMemHandle/OpenMemHandle per segment, cuda.core's pool
        export and import, flatten's 3.1 GB bucket allocation and copy.
  warm  after an in-place update of every tensor (t.add_(1), synchronize),
        a handoff of the same tensors again, the consumer having dropped
        every tensor of the last handoff first (closed its bundle, deleted
        its tensors: what an inference engine does between weight updates,
        and what makes a per-tensor or per-segment cache go cold).
        --warm-keep gives the earlier definition: the consumer still holds
        every earlier handoff of the repetition.

--layout moe: Qwen3-30B-A3B's layout, --moe-layers of its 48 (12: 4,719
tensors, 16.2 GB in bf16). Printed first, and kept in the JSON: the copy
floor, one flat device copy of the state dict's bytes in the producer (the
physical floor of a consumer's update).

Also reported: the caching allocator's segments holding the state dict (the
floor for (usmipc) and (torch.mp): one driver open per segment), the bytes
a warm handoff sends, and for usmipc the counters of usmipc.stats() in both processes (a warm
handoff should make no driver export or import and move no descriptor).
torch.multiprocessing's rebuild does not wait for the share's IPC event when
the consumer holds the storage already (a cache hit): flatten synchronizes
after its copy for that reason, and a warm torch.mp handoff is only correct
here because the producer synchronized before it.

  python3 bench/bench_weights.py [--reps 10] [--warm 3] [--methods LIST]
      [--small] [--layout qwen|moe] [--moe-layers 12] [--warm-keep]
      [--update] [--device cuda:gpu:0] [--json FILE]
  python3 bench/bench_weights.py --host [--small]   # CPU smoke run: the
      usmipc bundle path on the host backend, numpy arrays in a usmipc host
      MemoryPool (usmipc-pool) or one usmipc allocation each (usmipc-alloc),
      the Qwen structure at small shapes (338 float32 tensors, 4.2 MB)

--update: the consumer's update instead of the handoff alone: it also
copies every tensor into weights of its own, allocated before timing (the
usmipc methods but >torch: one UpdatePlan.update call; the others: a copy_
per tensor), synchronized; the ratio to the copy floor is printed. Fan-out
to N consumers is tests/gpu/fanout_bench.py.

--methods takes names or letters (a=usmipc b=usmipc-pool c=torch.mp
d=flatten e=cuda.core f=usmipc>torch g=usmipc-pool>torch h=usmipc-pool>torch
kept i=usmipc kept j=usmipc-pool kept k=usmipc-exp l=usmipc-exp kept). Needs the bundle API (usmipc.share, open_shared,
close_shared, stats); a method whose library is missing says so and the
others run. Exit status 1 when a method failed (a consumer that read other
values than the producer's, in the first repetition's checks, fails it) or
the usmipc bundle API is missing, --host included; a missing cuda.core is
only reported. The module imports nothing beyond the standard library at
the top, so it is safe to import anywhere.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
import types

MiB = 1 << 20

GPU_METHODS = ["usmipc", "usmipc kept", "usmipc-exp", "usmipc-exp kept",
               "usmipc-pool", "usmipc-pool kept", "usmipc>torch",
               "usmipc-pool>torch", "torch.mp", "flatten", "cuda.core"]
HOST_METHODS = ["usmipc-pool", "usmipc-pool kept", "usmipc-alloc",
                "usmipc-alloc kept"]
LETTERS = {"a": "usmipc", "b": "usmipc-pool", "c": "torch.mp",
           "d": "flatten", "e": "cuda.core", "f": "usmipc>torch",
           "g": "usmipc-pool>torch", "h": "usmipc-pool>torch kept",
           "i": "usmipc kept", "j": "usmipc-pool kept", "k": "usmipc-exp",
           "l": "usmipc-exp kept"}
LABELS = {
    "usmipc": "usmipc bundle, caching-allocator tensors",
    "usmipc-pool": "usmipc bundle, tensors in a usmipc pool",
    "usmipc-alloc": "usmipc bundle, one usmipc allocation per array",
    "usmipc>torch": "usmipc bundle, caching-allocator tensors, "
                    "open_shared(to='torch')",
    "usmipc-pool>torch": "usmipc bundle, pool tensors, open_shared(to='torch')",
    "usmipc-pool>torch kept": "the same, warm handoffs resend the kept bundle",
    "usmipc kept": "usmipc bundle kept by the producer, caching-allocator "
                   "tensors, SharedArray leaves",
    "usmipc-pool kept": "usmipc bundle kept by the producer, pool tensors, "
                        "SharedArray leaves",
    "usmipc-exp": "usmipc bundle, tensors from expandable segments",
    "usmipc-exp kept": "usmipc bundle kept by the producer, expandable "
                       "segments, SharedArray leaves",
    "usmipc-alloc kept": "usmipc bundle kept by the producer, one usmipc "
                         "allocation per array",
    "torch.mp": "torch.multiprocessing, reduce_tensor per tensor",
    "flatten": "flatten into one bucket + one reduce_tensor",
    "cuda.core": "cuda.core IPC pool, descriptor per buffer",
}

QWEN_TENSORS = 338
QWEN_BYTES = 3_087_428_608     # 1,543,714,304 bf16 parameters


# ---- the state dict ---------------------------------------------------------

def qwen2_spec(layers=28, hidden=1536, intermediate=8960, heads=12,
               kv_heads=2, head_dim=128, vocab=151936):
    """(name, shape) in checkpoint order; tied embeddings: no lm_head."""
    q, kv = heads * head_dim, kv_heads * head_dim
    spec = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        spec += [
            (p + "self_attn.q_proj.weight", (q, hidden)),
            (p + "self_attn.q_proj.bias", (q,)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (hidden, q)),
            (p + "mlp.gate_proj.weight", (intermediate, hidden)),
            (p + "mlp.up_proj.weight", (intermediate, hidden)),
            (p + "mlp.down_proj.weight", (hidden, intermediate)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    spec.append(("model.norm.weight", (hidden,)))
    return spec


# --small: ten tensors of one tiny layer.
SMALL_SPEC = [
    ("model.embed_tokens.weight", (1000, 64)),
    ("model.layers.0.self_attn.q_proj.weight", (64, 64)),
    ("model.layers.0.self_attn.q_proj.bias", (64,)),
    ("model.layers.0.self_attn.k_proj.weight", (16, 64)),
    ("model.layers.0.self_attn.v_proj.weight", (16, 64)),
    ("model.layers.0.self_attn.o_proj.weight", (64, 64)),
    ("model.layers.0.mlp.gate_proj.weight", (128, 64)),
    ("model.layers.0.mlp.up_proj.weight", (128, 64)),
    ("model.layers.0.mlp.down_proj.weight", (64, 128)),
    ("model.norm.weight", (64,)),
]

# The throwaway handoff that warms both processes up.
TINY_SPEC = [("warmup.a", (16,)), ("warmup.b", (4, 8))]


def moe_spec(layers=12, hidden=2048, heads=32, kv_heads=4, head_dim=128,
             experts=128, intermediate=768, vocab=151936):
    """Qwen3-30B-A3B's layout (names and shapes of the checkpoint), `layers`
    of its 48: 4,719 tensors and 16.2 GB in bf16 at 12, 18,867 at 48."""
    q, kv = heads * head_dim, kv_heads * head_dim
    spec = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        spec += [(p + "self_attn.q_proj.weight", (q, hidden)),
                 (p + "self_attn.k_proj.weight", (kv, hidden)),
                 (p + "self_attn.v_proj.weight", (kv, hidden)),
                 (p + "self_attn.o_proj.weight", (hidden, q)),
                 (p + "self_attn.q_norm.weight", (head_dim,)),
                 (p + "self_attn.k_norm.weight", (head_dim,)),
                 (p + "input_layernorm.weight", (hidden,)),
                 (p + "post_attention_layernorm.weight", (hidden,)),
                 (p + "mlp.gate.weight", (experts, hidden))]
        for e in range(experts):
            x = f"{p}mlp.experts.{e}."
            spec += [(x + "gate_proj.weight", (intermediate, hidden)),
                     (x + "up_proj.weight", (intermediate, hidden)),
                     (x + "down_proj.weight", (hidden, intermediate))]
    spec += [("model.norm.weight", (hidden,)),
             ("lm_head.weight", (vocab, hidden))]
    return spec


# The MoE at small shapes, for --host and --small: the same structure.
SMALL_MOE = dict(layers=2, hidden=64, heads=4, kv_heads=1, head_dim=16,
                 experts=8, intermediate=32, vocab=1000)


def copy_floor_ms(cfg, nbytes, reps=7):
    """The physical floor of an update: one flat copy of the state dict's
    bytes on the device (torch's copy_, synchronized), median of reps, in
    this process; on --host a numpy copy in host memory."""
    if cfg["host"]:
        import numpy as np
        a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            np.copyto(b, a)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:]) * 1e3
    import torch
    dev = f"cuda:{gpu_index(cfg['device'])}"
    a = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return statistics.median(times[1:]) * 1e3


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def round_up(n, to):
    return (n + to - 1) // to * to


# ---- small helpers ----------------------------------------------------------

class Unavailable(Exception):
    """A method's library or API is missing: reported, the others run."""


def errstr(e):
    return f"{type(e).__name__}: {e}"


def gpu_index(device):
    """cuda:gpu:N -> N."""
    tail = device.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def stats_delta(now, base):
    if now is None or base is None:
        return None
    return {k: now[k] - base.get(k, 0) for k in now}


def summary_ms(samples_us):
    if not samples_us:
        return None
    s = sorted(samples_us)
    return {"median_ms": statistics.median(s) / 1e3, "min_ms": s[0] / 1e3,
            "max_ms": s[-1] / 1e3, "n": len(s)}


def torch_dtype_name(t):
    return str(t.dtype).replace("torch.", "")


def torch_check(tensors):
    """{name: (shape, dtype, first, last)} of a dict of torch tensors: one
    gather and one copy to the host for all of them."""
    import torch
    parts = []
    for t in tensors.values():
        f = t.reshape(-1)
        if f.numel():
            parts += [f[:1].float(), f[-1:].float()]
    vals = torch.cat(parts).cpu().tolist() if parts else []
    out, i = {}, 0
    for name, t in tensors.items():
        if t.numel():
            first, last = vals[i], vals[i + 1]
            i += 2
        else:
            first = last = None
        out[name] = (tuple(t.shape), torch_dtype_name(t), first, last)
    return out


def numpy_check(arrays):
    out = {}
    for name, a in arrays.items():
        f = a.reshape(-1)
        out[name] = (tuple(a.shape), str(a.dtype),
                     float(f[0]) if f.size else None,
                     float(f[-1]) if f.size else None)
    return out


class CudaArray:
    """Raw device bytes as __cuda_array_interface__ (torch.as_tensor views
    them without a copy and keeps this object alive)."""

    def __init__(self, ptr, nbytes, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
            "strides": None, "version": 3}


def caching_segments(tensors):
    """Distinct caching-allocator segments holding these tensors."""
    import bisect
    import torch
    segs = sorted((s["address"], s["address"] + s["total_size"])
                  for s in torch.cuda.memory_snapshot())
    starts = [a for a, _ in segs]
    found = set()
    for t in tensors.values():
        p = t.data_ptr()
        i = bisect.bisect_right(starts, p) - 1
        if i >= 0 and segs[i][0] <= p < segs[i][1]:
            found.add(segs[i][0])
    return len(found)


BUNDLE_MAGIC = b"\x89USMIPCB"
CUDA_HANDLE_KINDS = {1: "native", 2: "fd"}


CHUNKS_RECORD = 0x8102


def handle_chunks(h):
    """[(chunk size, count), ...] of a memory handle whose allocation is
    physical chunks mapped back to back (record 0x8102, "chunks", of
    docs/handle-format.md: PyTorch's expandable segments), else None. The
    records follow the payload: u16 payload length at byte 208, u16 records
    length at 210, records from 212 + payload, each u16 type, u16 length."""
    import struct
    plen, elen = struct.unpack_from("<HH", h, 208)
    pos, end = 212 + plen, 212 + plen + elen
    while pos + 4 <= end:
        rtype, rlen = struct.unpack_from("<HH", h, pos)
        body = h[pos + 4:pos + 4 + rlen]
        pos += 4 + rlen
        if rtype == CHUNKS_RECORD:
            _, runs = struct.unpack_from("<HH", body, 0)
            return [struct.unpack_from("<QI", body, 8 + 16 * i)
                    for i in range(runs)]
    return None


def bundle_allocations(raw):
    """{"kind": native or fd, "sizes": {size: count}} of the allocations a
    bundle's bytes name, each once (docs/handle-format.md, Bundles: S at
    byte 48, then S times a u16 length and a v2 memory handle after the
    64-byte header; each handle read by IPCMemoryHandle.inspect, which
    checks it): what its cold handoff exports and imports. An allocation of
    physical chunks (expandable segments) counts as its chunks, each
    exported, moved, imported and mapped on its own, as usmipc does (the
    floor program reserves an address range per chunk where usmipc reserves
    one per allocation: a floor a little above the least). None for other
    bytes, for memory other than CUDA's, or for allocations of mixed
    kinds."""
    import collections
    import struct
    from usmipc.memory import IPCMemoryHandle
    raw = bytes(raw)
    if raw[:8] != BUNDLE_MAGIC:
        return None
    (count,) = struct.unpack_from("<I", raw, 48)
    pos, kinds, sizes = 64, set(), collections.Counter()
    for _ in range(count):
        (n,) = struct.unpack_from("<H", raw, pos)
        h = raw[pos + 2:pos + 2 + n]
        pos += 2 + n
        info = IPCMemoryHandle.inspect(h)
        kinds.add(CUDA_HANDLE_KINDS.get(info["handle_kind"])
                  if info["backend"] == "cuda" else None)
        chunks = handle_chunks(h)
        if chunks:  # each chunk its own export, descriptor, import and map
            for size, k in chunks:
                sizes[size] += k
        else:
            sizes[info["allocation_size"]] += 1
    if len(kinds) != 1 or None in kinds:
        return None
    return {"kind": kinds.pop(), "sizes": dict(sizes)}


COLD_FLOOR_BIN = "usmipc_bench_cold_floor"


def cold_floor(kind, sizes, device_index, rounds=5):
    """The CUDA driver's own cold handoff of allocations of these sizes
    (bench/c/bench_cold_floor.c: export, descriptor transfer, import and
    map, two processes, nothing of usmipc), as its JSON dict; a dict with
    "error" when the program is missing or fails. The program is looked
    for in $USMIPC_COLD_FLOOR_BIN, then build*/bench/ of this checkout."""
    import glob
    import json
    import subprocess
    exe = os.environ.get("USMIPC_COLD_FLOOR_BIN")
    if not exe:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        found = sorted(glob.glob(os.path.join(root, "build*", "bench",
                                              COLD_FLOOR_BIN)))
        if not found:
            return {"error": f"{COLD_FLOOR_BIN} not built (cmake --build "
                             f"BUILD builds it into BUILD/bench/)"}
        exe = found[0]
    arg = ",".join(f"{size}x{count}" for size, count in sorted(sizes.items()))
    try:
        r = subprocess.run([exe, "--kind", kind, "--sizes", arg, "--rounds",
                            str(rounds), "--device", str(device_index),
                            "--json", "-"], capture_output=True, text=True,
                           timeout=300)
    except Exception as e:
        return {"error": errstr(e)}
    if r.returncode != 0:
        return {"error": f"{exe} exited {r.returncode}: "
                         f"{r.stderr.strip()[-300:]}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- the methods: producer side (p_*) and consumer side (c_*) ---------------
#
# p_make allocates and fills a fresh state dict (untimed); p_handoff is the
# timed export, returning what goes through the pipe; p_after runs once the
# consumer answered; p_free drops the state. c_open turns a payload into
# {name: tensor} plus whatever must stay alive; c_sync waits for the
# consumer's stream. Everything imports its library inside: a missing one
# costs its method only.

class Method:
    name = ""
    uses_usmipc = False
    report_segments = False   # the caching allocator's segments are its floor

    def __init__(self, cfg):
        self.cfg = cfg

    def stats(self):
        if not self.uses_usmipc:
            return None
        import usmipc
        fn = getattr(usmipc, "stats", None)
        return dict(fn()) if fn is not None else None

    # producer
    def p_setup(self):
        pass

    def p_make(self, spec, seed):
        raise NotImplementedError

    def p_update(self, st):
        for t in st.tensors.values():
            t.add_(1)

    def p_sync(self):
        pass

    def p_handoff(self, st, cold):
        raise NotImplementedError

    def p_after(self, st):
        pass

    def p_free(self, st):
        st.__dict__.clear()

    def p_check(self, st):
        return torch_check(st.tensors)

    # consumer
    def c_setup(self):
        pass

    def c_open(self, payload):
        raise NotImplementedError

    def c_sync(self):
        pass

    def c_check(self, tensors):
        return torch_check(tensors)

    def c_close(self, holder):
        pass

    def c_drop(self):
        pass

    def p_teardown(self):
        pass

    # consumer, --update: the handoff copied into weights of its own,
    # allocated before anything is timed (c_alloc_dest) for each state
    # dict it will receive ("tiny" for the throwaway handoff, "main").
    def c_alloc_dest(self, spec):
        raise NotImplementedError

    def c_copy(self, dest, tensors):
        raise NotImplementedError

    def c_update(self, payload, sid):
        """(the destinations, the holder, the opened tensors): open as
        c_open does, then a copy per tensor into this process's weights,
        the way an engine does it without usmipc's plan."""
        tensors, holder = self.c_open(payload)
        dest = self.dest[sid]
        self.c_copy(dest, tensors)
        return dict(dest), holder, tensors


class TorchMethod(Method):
    """Common torch setup for the GPU methods."""

    def _torch(self):
        import torch
        self.torch = torch
        self.index = gpu_index(self.cfg["device"])
        torch.cuda.set_device(self.index)
        torch.cuda.init()
        self.tdev = torch.device("cuda", self.index)
        self.dtype = getattr(torch, self.cfg["dtype"])

    def p_setup(self):
        self._torch()
        self.stream = self.torch.cuda.current_stream()

    def c_setup(self):
        self._torch()
        self.cstream = self.torch.cuda.Stream(device=self.index)

    def p_sync(self):
        self.torch.cuda.synchronize()

    def c_sync(self):
        self.cstream.synchronize()

    def p_make(self, spec, seed):
        torch = self.torch
        torch.manual_seed(seed)
        tensors = {}
        for name, shape in spec:
            t = torch.empty(shape, dtype=self.dtype, device=self.tdev)
            t.normal_()
            tensors[name] = t
        torch.cuda.synchronize()
        st = types.SimpleNamespace(tensors=tensors)
        st.segments = caching_segments(tensors)
        return st

    def p_free(self, st):
        st.__dict__.clear()
        gc.collect()
        self.torch.cuda.synchronize()
        self.torch.cuda.ipc_collect()
        self.torch.cuda.empty_cache()

    def c_drop(self):
        gc.collect()
        self.torch.cuda.synchronize()

    def c_alloc_dest(self, spec):
        d = {name: self.torch.empty(shape, dtype=self.dtype, device=self.tdev)
             for name, shape in spec}
        self.torch.cuda.synchronize()
        return d

    def c_copy(self, dest, tensors):
        with self.torch.cuda.stream(self.cstream):
            for name, t in tensors.items():
                dest[name].copy_(t)


class UsmipcBundle(TorchMethod):
    name = "usmipc"
    uses_usmipc = True
    report_segments = True

    def _usmipc(self):
        import usmipc
        missing = [f for f in ("share", "open_shared", "close_shared")
                   if not hasattr(usmipc, f)]
        if missing:
            raise Unavailable(f"usmipc has no {', '.join(missing)}: the "
                              "bundle API is not in this build")
        self.usmipc = usmipc
        self.udev = usmipc.Device(self.cfg["device"])

    def p_setup(self):
        super().p_setup()
        self._usmipc()

    def c_setup(self):
        super().c_setup()
        self._usmipc()
        self.plans = {}

    def _share(self, tensors):
        return self.usmipc.share(tensors, stream=self.stream)

    def p_handoff(self, st, cold):
        b = self._share(st.tensors)
        st.pending = b
        return b.to_bytes()

    def c_update(self, payload, sid):
        """--update: usmipc's one-call update (UpdatePlan.update: open,
        ordered, every leaf copied in one unit of device work), a plan per
        destination set, made at its first update."""
        plan = self.plans.get(sid)
        if plan is None:
            plan = self.plans[sid] = self.usmipc.UpdatePlan(self.dest[sid])
        plan.update(payload, stream=self.cstream)
        return dict(self.dest[sid]), None, None

    def p_after(self, st):
        # The new bundle replaces the previous one only now: a bundle keeps
        # its exports alive, so a warm share finds them still exported.
        st.bundle = st.pending
        st.pending = None

    def c_open(self, payload):
        torch = self.torch
        tree = self.usmipc.open_shared(payload, device=self.udev,
                                       stream=self.cstream)
        self.t_opened = time.perf_counter_ns()
        with torch.cuda.stream(self.cstream):
            tensors = {k: torch.from_dlpack(v) for k, v in tree.items()}
        return tensors, tree

    def c_close(self, tree):
        self.usmipc.close_shared(tree)


class UsmipcPoolBundle(UsmipcBundle):
    name = "usmipc-pool"
    report_segments = False

    def p_make(self, spec, seed):
        from usmipc.memory import MemoryPool
        torch = self.torch
        torch.manual_seed(seed)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        sizes = [numel(shape) * itemsize for _, shape in spec]
        # Blocks are 256-byte aligned; capacity for all of them: one segment.
        pool = MemoryPool(round_up(sum(round_up(n, 256) for n in sizes) + MiB,
                                   2 * MiB), device=self.udev)
        tensors, mems = {}, []
        for (name, shape), n in zip(spec, sizes):
            mem = pool.allocate(n)
            t = torch.from_dlpack(mem).view(self.dtype).view(shape)
            t.normal_()
            tensors[name] = t
            mems.append(mem)
        torch.cuda.synchronize()
        return types.SimpleNamespace(tensors=tensors, pool=pool, mems=mems,
                                     segments=None)


class UsmipcToTorch(UsmipcBundle):
    """The same handoff, the consumer asking open_shared for torch tensors
    (made from capsules in C) instead of converting each leaf."""
    name = "usmipc>torch"

    def c_open(self, payload):
        tensors = self.usmipc.open_shared(payload, device=self.udev,
                                          stream=self.cstream, to="torch")
        self.t_opened = time.perf_counter_ns()
        return tensors, None

    def c_close(self, tree):
        pass  # each tensor keeps its mapping until it dies

    # --update: open_shared(to="torch") and a copy_ per tensor, without the
    # plan (what engines write today).
    c_update = Method.c_update


class UsmipcPoolToTorch(UsmipcPoolBundle):
    name = "usmipc-pool>torch"
    c_open = UsmipcToTorch.c_open
    c_close = UsmipcToTorch.c_close
    c_update = Method.c_update


class UsmipcPoolKept(UsmipcPoolToTorch):
    """Warm handoffs resend the bundle the producer kept (to_bytes() records
    a new event; the tree is not walked again): what a trainer that shares
    the same weights after every update does."""
    name = "usmipc-pool>torch kept"

    def p_handoff(self, st, cold):
        b = getattr(st, "bundle", None)
        if cold or b is None:
            b = self._share(st.tensors)
        st.pending = b
        return b.to_bytes()


class Kept:
    """Mixin: warm handoffs resend the bundle the producer kept, and the
    consumer's leaves are the SharedArrays open_shared returns (no torch
    tensor per leaf: the issue's "kept bundle with SharedArray leaves")."""
    p_handoff = UsmipcPoolKept.p_handoff

    def c_open(self, payload):
        tree = self.usmipc.open_shared(payload, device=self.udev,
                                       stream=self.cstream)
        self.t_opened = time.perf_counter_ns()
        return dict(tree), tree

    def c_check(self, leaves):
        torch = self.torch
        return torch_check({k: v if isinstance(v, torch.Tensor)
                            else torch.from_dlpack(v)
                            for k, v in leaves.items()})


class UsmipcKept(Kept, UsmipcBundle):
    name = "usmipc kept"


class UsmipcPoolKeptArrays(Kept, UsmipcPoolBundle):
    name = "usmipc-pool kept"


class Expandable:
    """Mixin: the producer's tensors come from PyTorch's expandable
    segments (switched on for this method only, at run time, and off again
    at its end)."""

    def p_setup(self):
        super().p_setup()
        try:
            self.torch.cuda.memory._set_allocator_settings(
                "expandable_segments:True")
        except Exception as e:
            raise Unavailable("this torch cannot switch expandable segments "
                              f"on at run time: {errstr(e)}")

    def p_make(self, spec, seed):
        st = super().p_make(spec, seed)
        snap = self.torch.cuda.memory_snapshot()
        if not any(seg.get("is_expandable") for seg in snap):
            raise Unavailable("expandable segments are not in effect (no "
                              "segment of torch.cuda.memory_snapshot() is)")
        return st

    def p_teardown(self):
        self.torch.cuda.empty_cache()
        self.torch.cuda.memory._set_allocator_settings(
            "expandable_segments:False")


class UsmipcExpandable(Expandable, UsmipcBundle):
    name = "usmipc-exp"


class UsmipcExpandableKept(Expandable, Kept, UsmipcBundle):
    name = "usmipc-exp kept"


class TorchMP(TorchMethod):
    name = "torch.mp"
    report_segments = True

    def p_setup(self):
        super().p_setup()
        from torch.multiprocessing.reductions import reduce_tensor
        self.reduce_tensor = reduce_tensor

    def p_handoff(self, st, cold):
        return {name: self.reduce_tensor(t) for name, t in st.tensors.items()}

    def c_open(self, payload):
        with self.torch.cuda.stream(self.cstream):   # rebuild waits on it
            tensors = {name: fn(*args) for name, (fn, args) in payload.items()}
        return tensors, None


class Flatten(TorchMP):
    name = "flatten"
    report_segments = False   # one bucket: one segment

    def p_handoff(self, st, cold):
        torch = self.torch
        flat = [t.reshape(-1) for t in st.tensors.values()]
        if cold:
            st.bucket = torch.cat(flat)
        else:
            torch.cat(flat, out=st.bucket)
        # rebuild skips the IPC event's wait on a cached storage (warm).
        self.stream.synchronize()
        meta = [(name, tuple(t.shape)) for name, t in st.tensors.items()]
        return {"bucket": self.reduce_tensor(st.bucket), "meta": meta}

    def c_open(self, payload):
        fn, args = payload["bucket"]
        meta = payload["meta"]
        with self.torch.cuda.stream(self.cstream):
            bucket = fn(*args)
            views = bucket.split([numel(shape) for _, shape in meta])
            tensors = {name: v.view(shape)
                       for (name, shape), v in zip(meta, views)}
        return tensors, bucket


class CudaCore(TorchMethod):
    name = "cuda.core"

    def _cc(self):
        try:
            try:
                import cuda.core as cc
                cc.DeviceMemoryResource  # noqa: B018  (1.x namespace)
            except (ImportError, AttributeError):
                import cuda.core.experimental as cc
            for attr in ("Device", "DeviceMemoryResource",
                         "DeviceMemoryResourceOptions", "Buffer"):
                if not hasattr(cc, attr):
                    raise AttributeError(f"{cc.__name__} has no {attr}")
            if not hasattr(cc.Buffer, "from_ipc_descriptor"):
                raise AttributeError("Buffer has no from_ipc_descriptor")
            if not hasattr(cc.DeviceMemoryResource, "from_allocation_handle"):
                raise AttributeError("DeviceMemoryResource has no "
                                     "from_allocation_handle")
        except Exception as e:
            raise Unavailable(f"cuda.core pool IPC unavailable: {errstr(e)}")
        self.cc = cc
        self.dev = cc.Device(self.index)
        self.dev.set_current()
        self.ccstream = self.dev.create_stream()
        self._no_stream_kw = set()
        self.close_errors = 0

    def _call(self, what, fn, *args):
        """fn(*args, stream=...) where this cuda.core takes it (1.x needs it
        for allocate and from_ipc_descriptor), else fn(*args); remembered
        per call site."""
        if what not in self._no_stream_kw:
            try:
                return fn(*args, stream=self.ccstream)
            except TypeError as e:
                if "stream" not in str(e):
                    raise
                self._no_stream_kw.add(what)
        return fn(*args)

    def p_setup(self):
        super().p_setup()
        self._cc()
        cc = self.cc
        # 1.x: property Buffer.ipc_descriptor, allocation_handle; 0.x methods.
        self._desc_prop = hasattr(cc.Buffer, "ipc_descriptor")
        self._handle_prop = hasattr(cc.DeviceMemoryResource,
                                    "allocation_handle")
        try:
            mr = self._new_mr(4 * MiB)
            b = self._call("allocate", mr.allocate, 4096)
            self._alloc_handle(mr)
            self._descriptor(b)
            b.close()
            mr.close()
        except Exception as e:
            raise Unavailable(f"cuda.core pool IPC unavailable: {errstr(e)}")

    def c_setup(self):
        super().c_setup()
        self._cc()
        self.mmrs = []

    def _new_mr(self, nbytes):
        opts = self.cc.DeviceMemoryResourceOptions(
            ipc_enabled=True, max_size=round_up(nbytes, 2 * MiB))
        return self.cc.DeviceMemoryResource(self.dev, opts)

    def _alloc_handle(self, mr):
        if self._handle_prop:
            h = mr.allocation_handle
            return h() if callable(h) else h
        return mr.get_allocation_handle()

    def _descriptor(self, buf):
        return buf.ipc_descriptor if self._desc_prop else buf.get_ipc_descriptor()

    def p_make(self, spec, seed):
        torch = self.torch
        torch.manual_seed(seed)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        sizes = [numel(shape) * itemsize for _, shape in spec]
        # Headroom: the driver's pool places allocations its own way.
        mr = self._new_mr(sum(round_up(n, 2 * MiB) for n in sizes) + 64 * MiB)
        bufs, tensors = [], {}
        for (name, shape), n in zip(spec, sizes):
            bufs.append((name, shape, n,
                         self._call("allocate", mr.allocate, n)))
        self.dev.sync()
        for name, shape, n, b in bufs:
            t = torch.as_tensor(CudaArray(int(b.handle), n, b), device=self.tdev)
            t = t.view(self.dtype).view(shape)
            t.normal_()
            tensors[name] = t
        torch.cuda.synchronize()
        return types.SimpleNamespace(tensors=tensors, mr=mr, bufs=bufs,
                                     segments=None)

    def p_handoff(self, st, cold):
        payload = {"descs": [(name, shape, n, self._descriptor(b))
                             for name, shape, n, b in st.bufs],
                   "dtype": self.cfg["dtype"]}
        if cold:
            # a POSIX fd: multiprocessing's reduction carries it (DupFd)
            payload["alloc_handle"] = self._alloc_handle(st.mr)
        return payload

    def p_free(self, st):
        st.tensors.clear()
        gc.collect()
        self.torch.cuda.synchronize()
        for _, _, _, b in st.bufs:
            b.close()
        st.mr.close()
        super().p_free(st)

    def c_open(self, payload):
        torch, cc = self.torch, self.cc
        if "alloc_handle" in payload:
            ah = payload["alloc_handle"]
            self.mmr = cc.DeviceMemoryResource.from_allocation_handle(self.dev, ah)
            self.mmrs.append((self.mmr, ah))
        dtype = getattr(torch, payload["dtype"])
        bufs, tensors = [], {}
        for name, shape, n, desc in payload["descs"]:
            b = self._call("import", cc.Buffer.from_ipc_descriptor, self.mmr,
                           desc)
            bufs.append(b)
            t = torch.as_tensor(CudaArray(int(b.handle), n, b), device=self.tdev)
            tensors[name] = t.view(dtype).view(shape)
        return tensors, bufs

    def c_close(self, bufs):
        # The same buffer imported once per handoff (cold + warm): a close
        # the driver refuses is counted, not fatal.
        for b in bufs:
            try:
                self._call("close", b.close)
            except Exception:
                self.close_errors += 1

    def c_drop(self):
        # The pool imported last stays open: the warm handoffs after a drop
        # (an engine drops its tensors between rounds) import from it again.
        # Those of earlier repetitions go.
        super().c_drop()
        for mmr, ah in self.mmrs[:-1]:
            for close in (mmr.close, getattr(ah, "close", None)):
                try:
                    if close is not None:
                        close()
                except Exception:   # the pool may have closed the fd itself
                    self.close_errors += 1
        self.mmrs = self.mmrs[-1:]


class HostBundle(Method):
    """--host: numpy arrays in usmipc host memory, one allocation each."""
    name = "usmipc-alloc"
    uses_usmipc = True

    def _setup(self):
        import numpy as np
        import usmipc
        if not hasattr(usmipc, "share"):
            raise Unavailable("usmipc has no share: the bundle API is not in "
                              "this build")
        self.np, self.usmipc = np, usmipc
        self.udev = usmipc.Device(self.cfg["device"])

    p_setup = c_setup = _setup

    def _alloc(self, sizes):
        from usmipc.memory import MemoryUSMDevice
        return None, [MemoryUSMDevice(n, device=self.udev) for n in sizes]

    def p_make(self, spec, seed):
        np = self.np
        rng = np.random.default_rng(seed)
        dtype = np.dtype(self.cfg["dtype"])
        sizes = [numel(shape) * dtype.itemsize for _, shape in spec]
        pool, mems = self._alloc(sizes)
        tensors = {}
        for (name, shape), mem in zip(spec, mems):
            a = np.from_dlpack(mem).view(dtype).reshape(shape)
            a[...] = rng.standard_normal(shape, dtype=dtype)
            tensors[name] = a
        return types.SimpleNamespace(tensors=tensors, pool=pool, mems=mems,
                                     segments=None)

    def p_update(self, st):
        for a in st.tensors.values():
            a += 1

    def p_handoff(self, st, cold):
        b = self.usmipc.share(st.tensors)
        st.pending = b
        return b.to_bytes()

    p_after = UsmipcBundle.p_after

    def p_check(self, st):
        return numpy_check(st.tensors)

    def c_open(self, payload):
        tree = self.usmipc.open_shared(payload, device=self.udev)
        return {k: self.np.from_dlpack(v) for k, v in tree.items()}, tree

    def c_check(self, tensors):
        return numpy_check(tensors)

    def c_close(self, tree):
        self.usmipc.close_shared(tree)

    def p_free(self, st):
        st.__dict__.clear()
        gc.collect()

    def c_drop(self):
        gc.collect()

    def c_alloc_dest(self, spec):
        dtype = self.np.dtype(self.cfg["dtype"])
        return {name: self.np.zeros(shape, dtype=dtype) for name, shape in spec}

    def c_copy(self, dest, tensors):
        for name, a in tensors.items():
            self.np.copyto(dest[name], a)

    def c_update(self, payload, sid):
        plans = self.__dict__.setdefault("plans", {})
        plan = plans.get(sid)
        if plan is None:
            plan = plans[sid] = self.usmipc.UpdatePlan(self.dest[sid])
        plan.update(payload)  # no stream: returns with the copies done
        return dict(self.dest[sid]), None, None


class HostPoolBundle(HostBundle):
    name = "usmipc-pool"

    def _alloc(self, sizes):
        from usmipc.memory import MemoryPool
        pool = MemoryPool(sum(round_up(n, 256) for n in sizes) + MiB,
                          device=self.udev)
        return pool, [pool.allocate(n) for n in sizes]


class HostKept:
    """Mixin for --host: warm handoffs resend the kept bundle."""

    def p_handoff(self, st, cold):
        b = getattr(st, "bundle", None)
        if cold or b is None:
            b = self.usmipc.share(st.tensors)
        st.pending = b
        return b.to_bytes()


class HostPoolKept(HostKept, HostPoolBundle):
    name = "usmipc-pool kept"


class HostAllocKept(HostKept, HostBundle):
    name = "usmipc-alloc kept"


GPU_CLASSES = {c.name: c for c in (UsmipcBundle, UsmipcKept,
                                   UsmipcExpandable, UsmipcExpandableKept,
                                   UsmipcPoolBundle, UsmipcPoolKeptArrays,
                                   UsmipcToTorch, UsmipcPoolToTorch,
                                   UsmipcPoolKept, TorchMP,
                                   Flatten, CudaCore)}
HOST_CLASSES = {c.name: c for c in (HostPoolBundle, HostPoolKept,
                                    HostBundle, HostAllocKept)}


def method_class(cfg, name):
    return (HOST_CLASSES if cfg["host"] else GPU_CLASSES)[name]


# ---- the consumer: one process per method -----------------------------------

def consumer_main(conn, name, cfg):
    try:
        m = method_class(cfg, name)(cfg)
        m.c_setup()
        if cfg.get("update"):  # the weights an engine keeps, before timing
            m.dest = {"tiny": m.c_alloc_dest(TINY_SPEC),
                      "main": m.c_alloc_dest(cfg["spec"])}
        base = m.stats()
        conn.send(("ready", os.getpid()))
    except BaseException as e:
        conn.send(("fatal", errstr(e), traceback.format_exc()))
        return
    # (tensors, holder, opened) of every handoff of this repetition; with
    # --update, tensors are the destinations and opened what was copied.
    held = []
    while True:
        msg = conn.recv()
        t_recv = time.perf_counter_ns()
        if msg[0] == "stop":
            break
        if msg[0] == "handoff":
            _, payload, verify, sid = msg
            try:
                m.t_opened = None
                if cfg.get("update"):
                    tensors, holder, opened = m.c_update(payload, sid)
                else:
                    (tensors, holder), opened = m.c_open(payload), None
                t_built = time.perf_counter_ns()
                m.c_sync()
                t_ready = time.perf_counter_ns()
                held.append((tensors, holder, opened))
                counters = stats_delta(m.stats(), base)
                check = m.c_check(tensors) if verify else None
                reply = ("done", t_recv, t_built, t_ready, counters, check,
                         getattr(m, "t_opened", None))
            except BaseException as e:
                reply = ("error", errstr(e), traceback.format_exc())
            del msg, payload
            conn.send(reply)
        elif msg[0] == "floor":  # the Pipe alone: when the bytes came
            conn.send(("floor", t_recv))
        elif msg[0] == "drop":
            try:
                for tensors, _, opened in held:
                    tensors.clear()
                    if opened is not None:
                        opened.clear()
                gc.collect()
                for _, holder, _ in held:
                    if holder is not None:  # None: the plan holds its own
                        m.c_close(holder)
                held.clear()
                m.c_drop()
                reply = ("dropped",)
            except BaseException as e:
                reply = ("error", errstr(e), traceback.format_exc())
            conn.send(reply)
        base = m.stats()


# ---- the producer -----------------------------------------------------------

class ConsumerError(Exception):
    pass


def answer(conn, proc, timeout):
    """The consumer's next message; a dead or stuck consumer ends the method
    with a message instead of a hang."""
    if not conn.poll(timeout):
        proc.kill()
        raise ConsumerError(f"the consumer did not answer in {timeout} s "
                            f"(exit code {proc.exitcode})")
    try:
        msg = conn.recv()
    except EOFError:
        proc.join(5)
        raise ConsumerError(f"the consumer died (exit code {proc.exitcode})")
    if msg[0] in ("error", "fatal"):
        raise ConsumerError(f"consumer: {msg[1]}\n{msg[2]}")
    return msg


def handoff(m, conn, proc, st, cold, verify, timeout, sid="main"):
    m.p_sync()
    base = m.stats()
    t0 = time.perf_counter_ns()
    payload = m.p_handoff(st, cold)
    t1 = time.perf_counter_ns()
    conn.send(("handoff", payload, verify, sid))
    t2 = time.perf_counter_ns()
    _, t_recv, t_built, t_ready, cstats, check, t_opened = answer(
        conn, proc, timeout)
    m.p_after(st)
    rec = {"total_us": (t_ready - t0) / 1e3,
           "export_us": (t1 - t0) / 1e3,         # share / reduce / cat
           "send_us": (t2 - t1) / 1e3,           # pickling + pipe write
           "transfer_us": (t_recv - t1) / 1e3,   # ... + consumer's unpickle
           "open_us": (t_built - t_recv) / 1e3,  # open + torch tensors
           "wait_us": (t_ready - t_built) / 1e3, # consumer stream sync
           # usmipc: open_shared alone, before torch.from_dlpack per leaf
           "open_shared_us": (None if t_opened is None
                              else (t_opened - t_recv) / 1e3),
           "producer_stats": stats_delta(m.stats(), base),
           "consumer_stats": cstats}
    if verify:
        mine = m.p_check(st)
        if check != mine:
            bad = sorted(k for k in set(mine) | set(check)
                         if mine.get(k) != check.get(k))
            raise AssertionError(
                f"consumer's tensors differ from the producer's in {len(bad)} "
                f"of {len(mine)}: {bad[:3]}, e.g. producer "
                f"{mine.get(bad[0])} consumer {check.get(bad[0])}")
    if cold and isinstance(payload, (bytes, bytearray)):
        al = bundle_allocations(payload)
        if al is not None:
            rec["allocations"] = al
    if not cold and verify:
        try:
            from multiprocessing.reduction import ForkingPickler
            rec["payload_bytes"] = len(ForkingPickler.dumps(payload))
        except Exception:
            pass
        if isinstance(payload, (bytes, bytearray)):
            rec["payload_bytes"] = len(payload)
    return rec


def pipe_floor(conn, proc, recs, n=9):
    """The Pipe's own part of a handoff's transfer: a bytes object of the
    warm payload's size sent the same way (in the same message tuple) and
    timed to the consumer's receipt, medians of n: (to a consumer that has
    just answered, to one idle for 20 ms first). A handoff's consumer has
    been idle while the producer updated its weights: its wake from idle
    is part of the transfer, and the machine's. None without a payload
    size."""
    size = next((r["payload_bytes"] for r in recs if "payload_bytes" in r),
                None)
    if not size:
        return None
    blob, out = bytes(size), []
    for idle in (0.0, 0.02):
        times = []
        for _ in range(n):
            if idle:
                time.sleep(idle)
            t0 = time.perf_counter_ns()
            conn.send(("floor", blob, False, "floor"))
            _, t_recv = answer(conn, proc, 60)
            times.append((t_recv - t0) / 1e3)
        out.append(statistics.median(times))
    return out


def drop(conn, proc):
    conn.send(("drop",))
    answer(conn, proc, 60)


def run_method(name, spec, cfg, reps, warm, keep=False):
    import multiprocessing as mp
    m = method_class(cfg, name)(cfg)
    m.p_setup()                                   # Unavailable: caller says so
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=consumer_main, args=(child, name, cfg),
                       daemon=True)
    proc.start()
    child.close()
    out = {"label": LABELS[name], "cold": [], "warm": []}
    try:
        answer(conn, proc, 120)                   # imports, CUDA context
        tiny = m.p_make(TINY_SPEC, seed=0)        # the throwaway handoff
        handoff(m, conn, proc, tiny, True, True, 60, "tiny")
        m.p_update(tiny)
        handoff(m, conn, proc, tiny, False, True, 60, "tiny")
        drop(conn, proc)
        m.p_free(tiny)
        for rep in range(reps):
            st = m.p_make(spec, seed=rep + 1)
            if rep == 0 and m.report_segments:
                out["segments"] = st.segments
            out["cold"].append(handoff(m, conn, proc, st, True, rep == 0, 60))
            if rep == 0 and not cfg["host"]:  # the cold floor's allocations
                al = out["cold"][0].pop("allocations", None)
                if al is not None:
                    out["allocations"] = al
            for w in range(warm):
                if not keep:  # an engine drops last round's tensors
                    drop(conn, proc)
                m.p_update(st)
                out["warm"].append(handoff(m, conn, proc, st, False,
                                           rep == 0 and w == 0, 60))
            drop(conn, proc)
            m.p_free(st)
            del st
        out["pipe_floor_us"] = pipe_floor(conn, proc, out["warm"])
        out["verified"] = True
    finally:
        try:
            m.p_teardown()
        except Exception:
            pass
        try:
            conn.send(("stop",))
            proc.join(20)
        except Exception:
            pass
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    return out


def summarize(out):
    for phase in ("cold", "warm"):
        recs = out[phase]
        if not recs:
            continue
        s = summary_ms([r["total_us"] for r in recs])
        for part in ("export_us", "transfer_us", "open_us", "wait_us"):
            s[part.replace("_us", "_median_ms")] = statistics.median(
                r[part] for r in recs) / 1e3
        if recs[0].get("open_shared_us") is not None:
            s["open_shared_median_ms"] = statistics.median(
                r["open_shared_us"] for r in recs) / 1e3
        s["samples_ms"] = [r["total_us"] / 1e3 for r in recs]
        # cold: the first repetition's counters; warm: summed over every
        # warm handoff (all zero is the claim).
        for side in ("producer_stats", "consumer_stats"):
            if recs[0][side] is None:
                s[side] = None
            elif phase == "cold":
                s[side] = recs[0][side]
            else:
                s[side] = {k: sum(r[side][k] for r in recs)
                           for k in recs[0][side]}
        s["payload_bytes"] = next((r["payload_bytes"] for r in recs
                                   if "payload_bytes" in r), None)
        out[phase + "_summary"] = s


def fmt_stats(s):
    if not s:
        return "-"
    return (f"exp {s.get('driver_exports', '?')} / imp "
            f"{s.get('driver_imports', '?')} / desc "
            f"{s.get('descriptors_sent', 0) + s.get('descriptors_received', 0)}")


def versions(cfg):
    v = {"python": sys.version.split()[0]}
    try:
        import usmipc
        v["usmipc"] = usmipc.__version__
    except Exception as e:
        v["usmipc"] = errstr(e)
    if not cfg["host"]:
        from importlib.metadata import version
        for pkg in ("torch", "numpy", "cupy", "cupy-cuda13x", "cupy-cuda12x",
                    "cuda-core", "cuda-python", "cuda-bindings"):
            try:
                v[pkg] = version(pkg)
            except Exception:
                pass
        try:
            import torch
            v["gpu"] = torch.cuda.get_device_name(gpu_index(cfg["device"]))
        except Exception as e:
            v["gpu"] = errstr(e)
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10,
                    help="cold handoffs, each of a fresh state dict")
    ap.add_argument("--warm", type=int, default=3,
                    help="warm handoffs after each cold one")
    ap.add_argument("--methods", help="comma list of names or letters a-e")
    ap.add_argument("--small", action="store_true",
                    help="a 10-tensor tiny state dict, for a quick run")
    ap.add_argument("--host", action="store_true",
                    help="CPU smoke run: usmipc bundles of numpy arrays in "
                         "usmipc host memory")
    ap.add_argument("--device", help="default cuda:gpu:0, or host:cpu "
                                     "with --host")
    ap.add_argument("--layout", choices=["qwen", "moe"], default="qwen",
                    help="Qwen2.5-1.5B (338 tensors, 3.1 GB) or the MoE "
                         "(Qwen3-30B-A3B's layout, --moe-layers of 48)")
    ap.add_argument("--moe-layers", type=int, default=12,
                    help="the MoE's layers (12: 4,719 tensors, 16.2 GB)")
    ap.add_argument("--warm-keep", action="store_true",
                    help="the old warm round: the consumer keeps every "
                         "handoff of a repetition open (default: it drops "
                         "the last round's tensors first, as engines do)")
    ap.add_argument("--update", action="store_true",
                    help="time the update instead of the handoff: the "
                         "consumer also copies every tensor into weights of "
                         "its own (usmipc: UpdatePlan.update, one call; "
                         "the others and usmipc's >torch methods: a copy_ "
                         "per tensor)")
    ap.add_argument("--json")
    args = ap.parse_args()

    if args.host and args.layout == "moe":
        spec = moe_spec(**SMALL_MOE)
        cfg = {"host": True, "device": args.device or "host:cpu",
               "dtype": "float32", "itemsize": 4}
        methods = HOST_METHODS
    elif args.host:
        spec = SMALL_SPEC if args.small else qwen2_spec(
            hidden=64, intermediate=128, heads=4, kv_heads=1, head_dim=16,
            vocab=1024)
        cfg = {"host": True, "device": args.device or "host:cpu",
               "dtype": "float32", "itemsize": 4}
        methods = HOST_METHODS
    else:
        if args.layout == "moe":
            spec = moe_spec(**SMALL_MOE) if args.small else moe_spec(
                layers=args.moe_layers)
        else:
            spec = SMALL_SPEC if args.small else qwen2_spec()
        cfg = {"host": False, "device": args.device or "cuda:gpu:0",
               "dtype": "bfloat16", "itemsize": 2}
        methods = GPU_METHODS
    cfg["update"] = args.update
    if args.update:
        cfg["spec"] = spec
    if args.methods:
        methods = [LETTERS.get(x.strip(), x.strip())
                   for x in args.methods.split(",") if x.strip()]
        known = HOST_CLASSES if args.host else GPU_CLASSES
        bad = [x for x in methods if x not in known]
        if bad:
            ap.error(f"unknown method(s) {bad}; choose from {sorted(known)}")

    n_tensors = len(spec)
    total = sum(numel(s) for _, s in spec) * cfg["itemsize"]
    if spec is not SMALL_SPEC and not args.host and args.layout == "qwen":
        assert n_tensors == QWEN_TENSORS and total == QWEN_BYTES, \
            (n_tensors, total)
    warm_how = ("the consumer keeps every handoff open" if args.warm_keep
                else "the consumer drops the last round's tensors first")
    what = "update" if args.update else "handoff"
    print(f"{what}, state dict ({args.layout}): {n_tensors} tensors, "
          f"{total:,} bytes "
          f"({total / 1e9:.3f} GB), {cfg['dtype']}, on {cfg['device']}; "
          f"{args.reps} cold + {args.reps * args.warm} warm {what}s per "
          f"method; warm: {warm_how}", flush=True)
    floor = copy_floor_ms(cfg, total)
    print(f"copy floor: one flat copy of the {total:,} bytes, "
          f"{floor:.2f} ms (median of 7)", flush=True)

    results, notes = {}, []

    def write_json():
        # after every method: a run stopped by a timeout keeps what it has
        if not args.json:
            return
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "config": {"reps": args.reps, "warm": args.warm,
                                  "small": args.small, "host": args.host,
                                  "device": cfg["device"],
                                  "dtype": cfg["dtype"],
                                  "tensors": n_tensors, "bytes": total,
                                  "layout": args.layout,
                                  "warm_keep": args.warm_keep,
                                  "update": args.update,
                                  "copy_floor_ms": floor,
                                  "methods": methods},
                       "versions": vers,
                       "results": results}, f, indent=1)

    vers = versions(cfg)
    for name in methods:
        t0 = time.time()
        try:
            out = run_method(name, spec, cfg, args.reps, args.warm,
                             keep=args.warm_keep)
        except Unavailable as e:
            print(f"{name}: {e}", flush=True)
            notes.append(f"{name}: {e}")
            results[name] = {"label": LABELS[name], "unavailable": str(e)}
            write_json()
            continue
        except Exception as e:
            tb = traceback.format_exc()
            print(f"{name}: FAILED: {errstr(e)}\n{tb}", flush=True)
            results[name] = {"label": LABELS[name], "error": errstr(e),
                             "traceback": tb}
            write_json()
            continue
        summarize(out)
        out["seconds"] = round(time.time() - t0, 1)
        results[name] = out
        write_json()
        c, w = out.get("cold_summary"), out.get("warm_summary")
        ratio = (f"{w['median_ms'] / floor:.2f}x the copy floor; "
                 if args.update and w else "")
        print(f"{name}: cold {c['median_ms']:.2f} ms, warm "
              f"{w['median_ms']:.2f} ms ({ratio}{out['seconds']} s)"
              if c and w else f"{name}: done", flush=True)

    # The cold target's floor (issue 23): the driver's own cold handoff of
    # each method's allocations, run after every method (nothing else on
    # the GPU), once per distinct (kind, sizes).
    floors: dict = {}
    for name, r in results.items():
        al = r.get("allocations")
        if not al or args.update:
            continue
        key = (al["kind"], tuple(sorted(al["sizes"].items())))
        if key not in floors:
            floors[key] = cold_floor(al["kind"], al["sizes"],
                                     gpu_index(cfg["device"]))
        r["cold_floor"] = floors[key]
    write_json()

    print()
    print(f"{what}s, copy floor {floor:.2f} ms")
    print("| method | cold ms: median (min-max) | warm ms: median (min-max) "
          "| cold: export / transfer / open / wait ms | caching-allocator "
          "segments | usmipc cold: producer; consumer | usmipc warm "
          "(summed): producer; consumer |")
    print("|---|---:|---:|---|---:|---|---|")
    for name, r in results.items():
        if "cold_summary" not in r:
            why = r.get("unavailable") or ("FAILED: " + r.get("error", "?"))
            print(f"| {name} | {why} | | | | | |")
            continue
        c, w = r["cold_summary"], r.get("warm_summary")
        cell = lambda s: ("%.2f (%.2f-%.2f)" % (s["median_ms"], s["min_ms"],
                                                s["max_ms"]) if s else "-")
        parts = " / ".join("%.2f" % c[k] for k in (
            "export_median_ms", "transfer_median_ms", "open_median_ms",
            "wait_median_ms"))
        seg = r.get("segments")
        st = lambda s: (f"{fmt_stats(s['producer_stats'])}; "
                        f"{fmt_stats(s['consumer_stats'])}"
                        if s and s["producer_stats"] is not None else "-")
        print(f"| {name} | {cell(c)} | {cell(w)} | {parts} | "
              f"{seg if seg is not None else '-'} | {st(c)} | {st(w)} |")
    for name, r in results.items():
        parts = []
        for phase in ("cold", "warm"):
            x = r.get(f"{phase}_summary") or {}
            if x.get("open_shared_median_ms") is not None:
                parts.append(
                    f"{phase}: export {x['export_median_ms']:.2f}, "
                    f"open_shared {x['open_shared_median_ms']:.2f}, torch "
                    f"tensors {x['open_median_ms'] - x['open_shared_median_ms']:.2f}")
        if parts:
            print(f"{name}: median ms, " + "; ".join(parts))
    for name, r in results.items():
        w, pf = r.get("warm_summary"), r.get("pipe_floor_us")
        if w and pf is not None:
            print(f"{name}: warm transfer {w['transfer_median_ms']:.3f} ms; "
                  f"the Pipe alone, {w['payload_bytes']:,} bytes: "
                  f"{pf[0] / 1e3:.3f} ms to a consumer just done, "
                  f"{pf[1] / 1e3:.3f} ms to one idle 20 ms")
    for name, r in results.items():
        seg = r.get("segments")
        c = r.get("cold_summary")
        if seg and c:
            imports = (c["consumer_stats"] or {}).get("driver_imports")
            print(f"{name}: {seg} caching-allocator segments hold the state "
                  f"dict (the floor: one driver open each); the cold handoff "
                  f"is {c['median_ms'] * 1e3 / seg:.1f} us per segment"
                  + (f"; the consumer's driver imports: {imports}"
                     if imports is not None else ""))
    for name, r in results.items():
        cf, c = r.get("cold_floor"), r.get("cold_summary")
        if cf is None or c is None:
            continue
        if "error" in cf:
            print(f"{name}: no cold floor: {cf['error']}")
            continue
        exports = ((c.get("producer_stats") or {}).get("driver_exports"))
        target = cf["floor_ms"] + 2.0
        print(f"{name}: cold {c['median_ms']:.2f} ms against the target "
              f"{target:.2f} ms (the driver's own cold handoff of the same "
              f"{cf['allocations']} {cf['kind']} allocations, "
              f"{cf['bytes'] / 2**30:.2f} GiB: export {cf['export_ms']:.2f} "
              f" + import{' and map' if cf['kind'] == 'fd' else ''} "
              f"{cf['import_ms']:.2f} ms, + 2 ms; descriptor transfer "
              f"{cf['transfer_ms']:.2f} ms apart): "
              f"{'met' if c['median_ms'] <= target else 'NOT met'}"
              + (f"; usmipc's driver exports: {exports}"
                 if exports is not None else ""))
    for name in (n for n in results if n.startswith("usmipc")):
        w = results.get(name, {}).get("warm_summary")
        if w and w["consumer_stats"] is not None:
            print(f"{name} warm handoffs, usmipc.stats() summed over all "
                  f"{w['n']}: producer "
                  f"{w['producer_stats']}; consumer {w['consumer_stats']}")
    for n in notes:
        print(n)

    # A missing usmipc bundle API fails the run (it is what is measured); a
    # missing cuda.core is only reported.
    failed = [n for n, r in results.items() if "error" in r or (
        "unavailable" in r and n.startswith("usmipc"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
