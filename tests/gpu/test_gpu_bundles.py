"""Bundles on a real GPU (issue 11): usmipc.share() of a whole tree of
tensors in one producer, usmipc.open_shared() in a consumer process.

  - a state dict of torch tensors (bf16, fp16, fp32, int64, bool, a
    transposed and a stepped view, an interior slice, a zero-size tensor,
    nested dict/list/tuple) read back by torch and, where CuPy has the
    dtype, by CuPy: same nesting, shapes, strides, dtypes and values, and
    the same memory (a consumer's write is seen by the producer);
  - CuPy arrays (fp16, fp32, a stepped view, a transpose) read back by torch;
  - tensors in usmipc pool blocks (and a raw pool block): one driver import
    for all of them in the consumer;
  - ordering: the producer writes after a long kernel and shares with its
    stream at once; the consumer opens on its own stream and reads the new
    value every time, and share() returns while the kernel still runs;
  - a second share of the same tensors after an in-place update makes no
    driver export or import and moves no descriptor (usmipc.stats());
  - release tickets: the consumer queues a long kernel and a write on its
    stream and returns the ticket at once (release_shared(tree, stream));
    the producer's wait_released(stream) returns while that kernel still
    runs, and its stream then reads the consumer's write; without a stream
    the host waits for it.

The consumer is a separate interpreter (subprocess) that answers one request
per line; every wait on it has a timeout so that a hang fails fast. Runs
where torch, CuPy and a CUDA device are present (tests/gpu/run.sh); skips
elsewhere, and while the bundle API is missing from the build.
"""
import json
import pickle
import select
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

usmipc = pytest.importorskip("usmipc")
np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")

if not torch.cuda.is_available():  # pragma: no cover - CPU machines
    pytest.skip("no CUDA device for torch", allow_module_level=True)
try:
    GPU = usmipc.Device("cuda:gpu:0")
except Exception as exc:  # pragma: no cover - CPU machines
    pytest.skip(f"no CUDA device for usmipc: {exc}", allow_module_level=True)
if not all(hasattr(usmipc, f) for f in ("share", "open_shared", "close_shared",
                                        "stats")):
    pytest.skip("usmipc.share/open_shared/close_shared/stats missing: the "
                "bundle API is not in this build", allow_module_level=True)

from usmipc.memory import MemoryPool  # noqa: E402

TIMEOUT = 120  # seconds for any one answer of the consumer
SLEEP_MS = 100
ORDER_TRIALS = 10

# The consumer: one JSON request per line in, one hex pickle per line out.
#   {"op": "open", "data": hex, "cupy": bool, "stream": bool, "keep": bool,
#    "write": [path...] or null, "last": [path...] or null,
#    "release": {"cycles": n, "fill": [path...], "value": v} or null}
# open_shared's the bundle (on a torch stream of its own with "stream", else
# the host waits), describes every leaf as torch (and CuPy) see it, or with
# "last" only reads the last element of that leaf on its stream; "write"
# fills that leaf with 42 through torch; "keep" keeps the tree open.
# "release" queues a sleep of n cycles and then fills those leaves with v
# on its stream, returns the ticket after that work (on the device) and
# answers at once, without waiting for it (keep the tree: it is in use).
CONSUMER = textwrap.dedent(r"""
    import json, pickle, sys
    import numpy as np
    import torch
    import usmipc
    try:
        import cupy as cp
    except ImportError:
        cp = None
    torch.cuda.init()
    torch.empty(1, device="cuda")
    stream = torch.cuda.Stream()
    other = torch.cuda.Stream()  # reads on a stream the open was not on
    kept = []

    def skeleton(x):
        if isinstance(x, dict):
            return {k: skeleton(v) for k, v in x.items()}
        if isinstance(x, list):
            return [skeleton(v) for v in x]
        if isinstance(x, tuple):
            return tuple(skeleton(v) for v in x)
        return None

    def leaves(x, path=()):
        if isinstance(x, dict):
            for k, v in x.items():
                yield from leaves(v, path + (k,))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                yield from leaves(v, path + (i,))
        else:
            yield path, x

    def get(x, path):
        for p in path:
            x = x[p]
        return x

    def host(t):
        return (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy()

    def describe(leaf, with_cupy):
        t = torch.from_dlpack(leaf)
        d = {"dtype": leaf.dtype, "shape": tuple(leaf.shape),
             "strides": tuple(leaf.strides), "nbytes": leaf.nbytes,
             "torch_dtype": str(t.dtype).replace("torch.", ""),
             "torch_shape": tuple(t.shape), "torch_stride": tuple(t.stride()),
             "torch_values": host(t)}
        if with_cupy and cp is not None and leaf.dtype != "bfloat16":
            a = cp.from_dlpack(leaf)
            d.update(cupy_dtype=str(a.dtype), cupy_shape=tuple(a.shape),
                     cupy_strides=tuple(a.strides), cupy_values=cp.asnumpy(a))
        return d

    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        s0 = usmipc.stats()
        data = bytes.fromhex(req["data"])
        if req.get("stream"):
            # raw_stream: the stream given as its bare handle (an int)
            tree = usmipc.open_shared(data, stream=stream.cuda_stream
                                      if req.get("raw_stream") else stream)
        else:
            tree = usmipc.open_shared(data)
        out = {"skeleton": skeleton(tree)}
        if req.get("release"):
            rel = req["release"]
            with torch.cuda.stream(stream):
                torch.cuda._sleep(rel["cycles"])
                for path in rel["fill"]:
                    torch.from_dlpack(get(tree, path)).fill_(rel["value"])
            usmipc.release_shared(tree, stream=stream)
            out["released"] = True
        elif req.get("last"):
            with torch.cuda.stream(other if req.get("other") else stream):
                t = torch.from_dlpack(get(tree, req["last"]))
                out["last"] = host(t.reshape(-1)[-1:]).tolist()[0]
            del t
        else:
            out["leaves"] = {p: describe(leaf, req.get("cupy"))
                             for p, leaf in leaves(tree)}
        for path in req.get("write") or []:
            torch.from_dlpack(get(tree, path)).fill_(42)
            torch.cuda.synchronize()
        out["stats"] = {k: v - s0[k] for k, v in usmipc.stats().items()}
        if req.get("keep"):
            kept.append(tree)
        else:
            usmipc.close_shared(tree)
        del tree
        sys.stdout.write(pickle.dumps(out).hex() + "\n")
        sys.stdout.flush()
""")


class Consumer:
    def __init__(self):
        # stderr to a file: a chatty consumer must not fill a pipe and stall
        self.err = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen([sys.executable, "-c", CONSUMER],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.err, text=True)
        assert self._line(TIMEOUT) == "ready"

    def stderr(self):
        self.err.seek(0)
        return self.err.read()[-3000:]

    def _line(self, timeout):
        ready, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not ready:
            self.p.kill()
            self.p.wait(timeout=10)
            pytest.fail(f"the consumer did not answer in {timeout} s: "
                        f"{self.stderr()}")
        line = self.p.stdout.readline()
        if not line:
            self.p.wait(timeout=10)
            pytest.fail(f"the consumer died (exit {self.p.returncode}): "
                        f"{self.stderr()}")
        return line.strip()

    def open(self, data, **req):
        req["data"] = bytes(data).hex()
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        return pickle.loads(bytes.fromhex(self._line(TIMEOUT)))

    def close(self):
        try:
            self.p.stdin.close()
            self.p.wait(timeout=30)
        except Exception:
            self.p.kill()
        self.err.close()


@pytest.fixture
def consumer():
    c = Consumer()
    yield c
    c.close()


def skeleton(x):
    if isinstance(x, dict):
        return {k: skeleton(v) for k, v in x.items()}
    if isinstance(x, list):
        return [skeleton(v) for v in x]
    if isinstance(x, tuple):
        return tuple(skeleton(v) for v in x)
    return None


def leaves(x, path=()):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from leaves(v, path + (k,))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from leaves(v, path + (i,))
    else:
        yield path, x


def torch_host(t):
    return (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy()


def torch_dtype_name(t):
    return str(t.dtype).replace("torch.", "")


def delta(s0):
    return {k: v - s0[k] for k, v in usmipc.stats().items()}


def check_torch_leaf(path, t, got, with_cupy, want=None):
    """got: the consumer's description of the leaf at path; want: its
    values on the host (default: t's now)."""
    name = torch_dtype_name(t)
    where = f"leaf {path}"
    assert got["dtype"] == name, where
    assert got["shape"] == tuple(t.shape), where
    assert got["torch_dtype"] == name, where
    assert got["torch_shape"] == tuple(t.shape), where
    if t.numel():  # an empty tensor's strides say nothing
        assert got["strides"] == tuple(s * t.element_size()
                                       for s in t.stride()), where
        assert got["torch_stride"] == tuple(t.stride()), where
    assert got["nbytes"] == t.numel() * t.element_size(), where
    want = torch_host(t) if want is None else want
    assert np.array_equal(got["torch_values"], want), where
    if with_cupy and name != "bfloat16":
        assert got["cupy_dtype"] == name, where
        assert got["cupy_shape"] == tuple(t.shape), where
        if t.numel():
            assert got["cupy_strides"] == got["strides"], where
        assert np.array_equal(got["cupy_values"], want), where
    else:
        assert "cupy_values" not in got, where


# ---- (i) torch state dict, read by torch and CuPy ----------------------------

def torch_state():
    g = torch.Generator(device="cuda").manual_seed(11)
    dev = "cuda:0"

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    base = randn(48, 40)
    wide = randn(7, 33)
    ints = torch.arange(-500, 500, device=dev, dtype=torch.int64).reshape(10, 100)
    return {
        "bf16": randn(64, 32, dtype=torch.bfloat16),
        "fp16": randn(33, 17, dtype=torch.float16),
        "fp32": randn(1000),
        "int64": ints,
        "bool": randn(257) > 0,
        "empty": torch.empty(0, 5, device=dev),
        "nested": {
            "transposed": base.t(),               # strides (1, 40)
            "stepped": wide[:, ::3],              # strides (33, 3)
            "list": [torch.full((9,), 3.5, device=dev),
                     randn(4, 4, dtype=torch.float16)],
            "tuple": (ints[2:5, 1:],              # interior pointer
                      randn(3, 6, dtype=torch.bfloat16)[:, ::2]),
        },
    }


def test_torch_state_dict_read_by_torch_and_cupy(consumer):
    sd = torch_state()
    torch.cuda.synchronize()
    mine = dict(leaves(sd))
    want = {path: torch_host(t) for path, t in mine.items()}
    b = usmipc.share(sd, stream=torch.cuda.current_stream())
    # The consumer reads every leaf, then writes 42 into fp32.
    got = consumer.open(b.to_bytes(), cupy=True, write=[["fp32"]])
    assert got["skeleton"] == skeleton(sd)      # dict, list and tuple kept
    assert set(got["leaves"]) == set(mine)
    for path, t in mine.items():
        check_torch_leaf(path, t, got["leaves"][path], True, want[path])
    # The consumer's write went through its mapping into this memory.
    torch.cuda.synchronize()
    assert bool((sd["fp32"] == 42).all()), "the consumer's write is not seen"
    del b


def test_tensor_subclasses_read_by_torchs_readers(consumer):
    """A torch.Tensor subclass of the program's own (a framework's
    parameter class) is read through torch's C readers like a tensor, and
    one that rebinds data_ptr() in Python still sends its own bytes; the
    consumer reads each, and no per-leaf driver query is made for them
    (views of one allocation)."""
    class Param(torch.Tensor):
        pass

    class Lying(torch.Tensor):
        def data_ptr(self):
            return super().data_ptr() + 256

    base = torch.arange(4096, dtype=torch.float32, device="cuda")
    sd = {"param": base[:1024].view(32, 32).as_subclass(Param),
          "lying": base[1024:2048].as_subclass(Lying)}
    torch.cuda.synchronize()
    plain = {(k,): t.as_subclass(torch.Tensor) for k, t in sd.items()}
    want = {path: torch_host(t) for path, t in plain.items()}
    before = usmipc.stats()
    b = usmipc.share(sd, stream=torch.cuda.current_stream())
    queries = usmipc.stats()["driver_queries"] - before["driver_queries"]
    assert queries <= 1, queries  # one allocation
    got = consumer.open(b.to_bytes(), cupy=True)
    for path, t in plain.items():
        check_torch_leaf(path, t, got["leaves"][path], True, want[path])
    del b


# ---- (ii) CuPy arrays, read by torch ----------------------------------------

def test_cupy_arrays_read_by_torch(consumer):
    a = cp.random.default_rng(5).standard_normal((50, 40), dtype=cp.float32)
    tree = {"fp16": cp.arange(300, dtype=cp.float16).reshape(20, 15),
            "fp32": a, "stepped": a[::2, 5:], "transposed": a.T}
    cp.cuda.get_current_stream().synchronize()
    b = usmipc.share(tree, stream=cp.cuda.get_current_stream())
    got = consumer.open(b.to_bytes())
    assert got["skeleton"] == skeleton(tree)
    for path, x in leaves(tree):
        g = got["leaves"][path]
        assert g["dtype"] == str(x.dtype), path
        assert g["shape"] == x.shape and g["torch_shape"] == x.shape, path
        assert g["strides"] == x.strides, path
        assert g["torch_stride"] == tuple(s // x.itemsize for s in x.strides)
        assert g["torch_dtype"] == str(x.dtype), path
        assert np.array_equal(g["torch_values"], cp.asnumpy(x)), path
    del b


# ---- (iii) tensors in usmipc pool blocks --------------------------------------

def test_pool_tensors_one_import(consumer):
    pool = MemoryPool(device=GPU)
    m1 = pool.allocate(64 * 64 * 4)
    m2 = pool.allocate(1000 * 2)
    w = torch.from_dlpack(m1).view(torch.float32).view(64, 64)
    w.copy_(torch.arange(4096, dtype=torch.float32, device="cuda").view(64, 64))
    h = torch.from_dlpack(m2).view(torch.bfloat16)
    h.fill_(1.5)
    torch.cuda.synchronize()
    tree = {"w": w, "h": h, "w_t": w.t(), "raw": m1}   # raw: usmipc memory
    s0 = usmipc.stats()
    b = usmipc.share(tree, stream=torch.cuda.current_stream())
    got = consumer.open(b.to_bytes())
    produced = delta(s0)
    for key in ("w", "h", "w_t"):
        check_torch_leaf((key,), tree[key], got["leaves"][(key,)], False)
    raw = got["leaves"][("raw",)]
    assert raw["dtype"] == "uint8" and raw["shape"] == (64 * 64 * 4,)
    assert np.array_equal(raw["torch_values"],
                          w.cpu().numpy().view(np.uint8).reshape(-1))
    # Every leaf lives in the pool's one segment: one driver import, and
    # one export (the segment's) in the producer.
    assert got["stats"]["driver_imports"] == 1, (got["stats"], produced)
    assert produced["driver_exports"] <= 1, produced
    del b


# ---- (iv) ordering on the consumer's stream ------------------------------------

def sleep_cycles(ms):
    props = torch.cuda.get_device_properties(0)
    khz = getattr(props, "clock_rate", None) or 1980000
    return int(khz * ms)


@pytest.mark.parametrize("read_on", ["open's stream", "another stream",
                                     "another stream, the open's a handle"])
def test_ordered_open_on_consumer_stream(consumer, read_on):
    """The consumer's read is ordered after the producer's kernel, on the
    stream it opened on and on another one (its __dlpack__(stream=) waits
    for the open's stream; the ready record is made then, not at the
    open, unless the open's stream came as a bare handle: then at the
    open, as nothing keeps that stream alive)."""
    n = 1 << 20
    x = torch.zeros(n, dtype=torch.int32, device="cuda")
    y = torch.zeros(4096, dtype=torch.float32, device="cuda")
    s = torch.cuda.current_stream()
    ok, running = [], []
    for trial in range(ORDER_TRIALS + 1):   # trial 0: first export, first open
        torch.cuda.synchronize()
        x.zero_()
        torch.cuda._sleep(sleep_cycles(SLEEP_MS))
        x.fill_(1000 + trial)
        y.fill_(trial)
        b = usmipc.share({"x": x, "y": [y]}, stream=s)
        raw = b.to_bytes()
        running.append(not s.query())
        got = consumer.open(raw, stream=True, last=["x"],
                            other=read_on.startswith("another stream"),
                            raw_stream=read_on.endswith("a handle"))
        torch.cuda.synchronize()
        del b
        ok.append(got["last"] == 1000 + trial)
    running = running[1:]
    print(f"\nbundle ordering: {sum(ok)}/{len(ok)} reads saw the new value; "
          f"kernel still running after to_bytes in {sum(running)}/{len(running)}")
    assert all(ok), f"{ok.count(False)} of {len(ok)} ordered opens read stale data"
    assert all(running), "share()/to_bytes() waited for the producer's kernel"


# ---- (v) a second share of the same tensors costs no driver work -----------------

def test_second_share_moves_no_descriptor(consumer):
    pool = MemoryPool(device=GPU)
    sd = {f"layer{i}": torch.randn(256, 64, device="cuda").to(torch.bfloat16)
          for i in range(20)}
    sd["pooled"] = torch.from_dlpack(pool.allocate(4096)).view(torch.float32)
    sd["pooled"].fill_(2.0)
    torch.cuda.synchronize()
    s = torch.cuda.current_stream()
    b1 = usmipc.share(sd, stream=s)
    first = consumer.open(b1.to_bytes(), keep=True)
    for path, t in leaves(sd):
        check_torch_leaf(path, t, first["leaves"][path], False)
    for t in sd.values():
        t.add_(1)
    torch.cuda.synchronize()
    s0 = usmipc.stats()
    b2 = usmipc.share(sd, stream=s)         # b1 still alive: still exported
    second = consumer.open(b2.to_bytes(), keep=True)
    produced = delta(s0)
    for path, t in leaves(sd):
        check_torch_leaf(path, t, second["leaves"][path], False)
    print(f"\nsecond share: producer {produced}; consumer {second['stats']}")
    got = second["stats"]
    assert got["driver_imports"] == 0, got
    assert got["descriptors_received"] == 0, got
    assert produced["driver_exports"] == 0, produced
    assert produced["descriptors_sent"] == 0, produced
    del b1, b2


# ---- (vi) release tickets: the producer ordered after the consumer's work -----

def test_wait_released_is_ordered_after_the_consumers_kernel(consumer):
    x = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    y = torch.zeros(4096, dtype=torch.float32, device="cuda")
    s = torch.cuda.current_stream()
    b = usmipc.share({"x": x, "y": [y]}, stream=s, release=True)
    running = []
    for trial, how in enumerate(["stream", "host"] * 3):
        torch.cuda.synchronize()
        raw = b.to_bytes()
        assert b.releases == (trial + 1, trial)
        got = consumer.open(raw, stream=True, keep=True, release={
            "cycles": sleep_cycles(SLEEP_MS), "fill": [["x"], ["y", 0]],
            "value": 100 + trial})
        assert got["released"]
        assert b.releases == (trial + 1, trial + 1)
        if how == "stream":
            waits = usmipc.stats()["event_waits"]
            t0 = time.monotonic()
            b.wait_released(stream=s)      # s waits on the device
            spent = time.monotonic() - t0
            # ... for the consumer's kernel, if it still ran: a record
            # already complete is not waited for (event_waits unchanged).
            waited = usmipc.stats()["event_waits"] - waits
            assert spent < SLEEP_MS / 2e3, f"the host waited {spent:.3f} s"
            running.append(waited == 0 or not s.query())
        else:
            b.wait_released()              # the host waits for it
        # Read on s: after the consumer's write only if the wait was kept.
        assert x[-1].item() == 100 + trial, f"trial {trial} ({how})"
        assert y[0].item() == 100 + trial, f"trial {trial} ({how})"
    print(f"\nrelease: the producer's stream waited on the device, or "
          f"nothing was left to wait for, in {sum(running)}/{len(running)} "
          f"trials")
    assert all(running), "wait_released(stream) neither waited on the " \
        "device nor found the consumer's work complete"
    del b
