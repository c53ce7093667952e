"""usmipc.torch on CUDA: what tests/python/test_torch_reducers.py checks on
host memory, and what only a GPU shows (issue 24):

- ordering: work queued on a side stream before Queue.put() (pickled in the
  feeder thread) and before SimpleQueue.put() is seen by the receiver with
  no host sync on the sender;
- release: the receiver queues a long kernel on the tensor and drops it at
  once; the sender drops its own and allocates over and over; the kernel's
  result is intact (the ticket carried the receiver's event);
- repeated sends of the same tensors hit the caches (no driver export or
  import, no descriptor after the first), also when the receiver dropped
  the last round's tensors;
- CUDA storages travel (torch refuses them); empty tensors, Parameters;
- devices matched by UUID: a receiver whose CUDA_VISIBLE_DEVICES names the
  GPU by UUID, and by index;
- fd memory (expandable segments) outlives its sender; the caching
  allocator's memory loaded after its sender exited says what to use.
"""
import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import usmipc  # noqa: E402
import usmipc.torch as ut  # noqa: E402

TIMEOUT = 120
SPIN = 200_000_000  # torch.cuda._sleep cycles: about 100 ms on an H200


@pytest.fixture(autouse=True)
def routed():
    ut.install()
    ut.reset_stats()
    yield
    ut.uninstall()


def _reader(q, out, n):
    import usmipc.torch
    usmipc.torch.install()
    for _ in range(n):
        # SimpleQueue.get takes no timeout (run 47: a TypeError here left
        # the parent waiting on `out` until the step's limit).
        x = q.get() if type(q).__name__ == "SimpleQueue" else q.get(
            timeout=TIMEOUT)
        # The current stream waits for the sender's event: no host wait.
        out.put(x.sum().item())
        del x


@pytest.mark.parametrize("queue", ["Queue", "SimpleQueue"])
def test_side_stream_work_before_put_is_ordered(queue):
    ctx = multiprocessing.get_context("spawn")
    q, out = getattr(ctx, queue)(), ctx.Queue()
    p = ctx.Process(target=_reader, args=(q, out, 3))
    p.start()
    side = torch.cuda.Stream()
    kept = []
    for k in range(3):
        x = torch.zeros(1 << 20, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN)
            x.fill_(k + 1)
            q.put(x)  # no synchronize(): the put's event orders it
        kept.append(x)
        assert out.get(timeout=TIMEOUT) == float((k + 1) << 20)
    p.join(TIMEOUT)
    assert p.exitcode == 0


def _long_kernel_then_drop(q, out):
    import torch
    import usmipc.torch
    usmipc.torch.install()
    x = q.get(timeout=TIMEOUT)
    torch.cuda._sleep(SPIN * 5)  # about half a second on the stream
    y = x * 2  # reads x after the spin
    del x  # the ticket goes back now, with an event after y's kernel
    out.put("dropped")
    out.put(bool((y == 2).all().item()))


def test_memory_outlives_the_receivers_queued_work():
    ctx = multiprocessing.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_long_kernel_then_drop, args=(q, out))
    p.start()
    x = torch.ones(64 << 20, device="cuda")  # 256 MB
    torch.cuda.synchronize()
    q.put(x)
    del x
    assert out.get(timeout=TIMEOUT) == "dropped"
    # Would reuse x's block at once if the sender had let it go.
    junk = [torch.full((64 << 20,), 7.0, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    assert out.get(timeout=TIMEOUT) is True
    del junk
    p.join(TIMEOUT)
    assert p.exitcode == 0


def _receive_rounds(q, out, rounds):
    import usmipc
    import usmipc.torch
    usmipc.torch.install()
    for r in range(rounds):
        before = usmipc.stats()
        sd = q.get(timeout=TIMEOUT)
        ok = all(float(t[0]) == r for t in sd.values())
        after = usmipc.stats()
        out.put((ok, after["driver_imports"] - before["driver_imports"],
                 after["descriptors_received"] -
                 before["descriptors_received"]))
        del sd  # as engines do: the next round finds nothing held


def test_repeated_sends_hit_the_caches():
    ctx = multiprocessing.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_receive_rounds, args=(q, out, 4))
    p.start()
    sd = {f"w{i}": torch.empty(1 << 16, device="cuda") for i in range(64)}
    first = usmipc.stats()
    got = []
    for r in range(4):
        for t in sd.values():
            t.fill_(r)  # in place, as an optimizer step
        q.put(sd)
        got.append(out.get(timeout=TIMEOUT))
        if r == 0:
            exports = usmipc.stats()["driver_exports"]
    assert all(ok for ok, _, _ in got)
    assert [g[1:] for g in got[1:]] == [(0, 0)] * 3, got
    assert usmipc.stats()["driver_exports"] == exports > \
        first["driver_exports"] - 1
    st = ut.stats()
    assert st["cuda_tensors"] == st["routed_tensors"] == 4 * 64
    assert st["messages"] == st["bundles"] == 4
    p.join(TIMEOUT)


def _kinds(q, out):
    import torch
    import usmipc.torch
    usmipc.torch.install()
    d = q.get(timeout=TIMEOUT)
    out.put((type(d["s"]).__name__, d["s"].nbytes(), d["s"].device.type,
             tuple(d["e"].shape), d["e"].device.type,
             type(d["p"]).__name__, d["p"].requires_grad,
             d["v"].storage_offset(), d["v"].stride(),
             d["v"].tolist()))
    d["v"].add_(100)
    torch.cuda.synchronize()
    out.put("written")


def test_storages_empty_tensors_parameters_views():
    ctx = multiprocessing.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_kinds, args=(q, out))
    p.start()
    base = torch.arange(12.0, device="cuda").view(3, 4)
    q.put({"s": base.untyped_storage(), "e": torch.empty(0, 3, device="cuda"),
           "p": torch.nn.Parameter(base.clone()), "v": base[1:, 2]})
    assert out.get(timeout=TIMEOUT) == (
        "UntypedStorage", 48, "cuda", (0, 3), "cuda", "Parameter", True,
        6, (4,), [6.0, 10.0])
    assert out.get(timeout=TIMEOUT) == "written"
    assert base[1:, 2].tolist() == [106.0, 110.0]
    p.join(TIMEOUT)
    assert p.exitcode == 0


RECEIVER = """
import sys, torch, usmipc.torch
from multiprocessing.connection import Client
from multiprocessing.reduction import ForkingPickler
usmipc.torch.install()
c = Client(sys.argv[1], authkey=b"k")
t = ForkingPickler.loads(c.recv_bytes())
print(torch.cuda.device_count(), t.device.index, t.sum().item())
"""


@pytest.mark.parametrize("visible", ["uuid", "index"])
def test_the_receiver_names_the_gpu_its_own_way(visible, tmp_path):
    from multiprocessing.connection import Listener
    from multiprocessing.reduction import ForkingPickler
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="GPU-" + uuid
               if visible == "uuid" else "0")
    addr = str(tmp_path / "s")
    x = torch.full((1000,), 3.0, device="cuda")
    with Listener(addr, authkey=b"k") as lst:
        proc = subprocess.Popen([sys.executable, "-c", RECEIVER, addr],
                                stdout=subprocess.PIPE, env=env)
        lst.accept().send_bytes(ForkingPickler.dumps(x))
        outs, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0
    assert outs.decode().split() == ["1", "0", "3000.0"]


SENDER = """
import sys, torch, usmipc.torch
from multiprocessing.connection import Client
from multiprocessing.reduction import ForkingPickler
usmipc.torch.install()
x = torch.arange(1 << 20, device="cuda", dtype=torch.int32)
c = Client(sys.argv[1], authkey=b"k")
c.send_bytes(ForkingPickler.dumps(x))
if sys.argv[2] == "wait":
    c.recv()
"""


@pytest.mark.parametrize("alloc", ["expandable", "caching"])
def test_the_sender_exits(alloc, tmp_path):
    """fd memory (expandable segments) outlives its sender once loaded,
    without a word on stderr; the caching allocator's memory loaded after
    its sender exited fails saying what to use instead."""
    from multiprocessing.connection import Listener
    from multiprocessing.reduction import ForkingPickler
    env = dict(os.environ)
    if alloc == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    addr = str(tmp_path / "s")
    with Listener(addr, authkey=b"k") as lst:
        proc = subprocess.Popen(
            [sys.executable, "-c", SENDER, addr,
             "wait" if alloc == "expandable" else "exit"],
            stderr=subprocess.PIPE, env=env)
        conn = lst.accept()
        data = conn.recv_bytes()
        if alloc == "expandable":
            t = ForkingPickler.loads(data)
            conn.send("got")
        _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0 and err.decode().strip() == ""
    if alloc == "expandable":
        assert t.sum().item() == sum(range(1 << 20))
        return
    with pytest.raises(usmipc.Error, match="expandable_segments:True"):
        ForkingPickler.loads(data)


def _torch_share_cuda(out):
    import usmipc.torch
    usmipc.torch.install()
    x = torch.ones(2, device="cuda")
    spec = x.untyped_storage()._share_cuda_()
    out.put((len(spec), usmipc.torch.stats()["cuda_tensors"]))


def test_torch_rebuild_path_still_works():
    """torch's own storage._share_cuda_() / rebuild_cuda_tensor, which
    some code calls directly, is not routed and keeps working (in a process
    of its own, whose exit prints torch's "Producer process has been
    terminated" for the storage nobody opened, instead of pytest's; the
    handle opens in another process in torch's own test)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_torch_share_cuda, args=(out,))
    p.start()
    assert out.get(timeout=TIMEOUT) == (8, 0)
    p.join(TIMEOUT)
    assert p.exitcode == 0


def _gpu_forwarder(q, hop, out):
    """B: adds 1 on the GPU to what it received, puts a view of it on to C
    (the work finishes before the message goes), drops it and exits."""
    import usmipc.torch
    usmipc.torch.install()
    t = q.get(timeout=TIMEOUT)
    torch.cuda._sleep(SPIN)
    t.add_(1)
    hop.put(t[1:])
    # put() pickles in the queue's feeder thread: wait until it has, or
    # the count below may be read before (run 48 read 0).
    hop.close()
    hop.join_thread()
    out.put(usmipc.torch.stats()["forwarded"])
    del t
    q.get(timeout=TIMEOUT)


def _gpu_hop_reader(hop, out, go):
    import usmipc.torch
    usmipc.torch.install()
    t = hop.get(timeout=TIMEOUT)
    out.put(t.tolist())
    go.get(timeout=TIMEOUT)
    t.fill_(9)
    torch.cuda.synchronize()
    out.put("written")
    go.get(timeout=TIMEOUT)


def test_a_received_tensor_is_sent_on():
    """A -> B -> C with a CUDA tensor: B's kernel (after a long sleep)
    is finished before C reads; C writes into A's memory after B exited,
    and A sees it; A exported once."""
    ctx = multiprocessing.get_context("spawn")
    q, hop, out, go = (ctx.Queue() for _ in range(4))
    b = ctx.Process(target=_gpu_forwarder, args=(q, hop, out))
    c = ctx.Process(target=_gpu_hop_reader, args=(hop, out, go))
    b.start()
    c.start()
    try:
        t = torch.arange(4, dtype=torch.float32, device="cuda")
        q.put(t)
        got = [out.get(timeout=TIMEOUT) for _ in range(2)]
        assert sorted(got, key=str) == [1, [2.0, 3.0, 4.0]]
        q.put("done")
        b.join(TIMEOUT)
        assert b.exitcode == 0
        go.put(1)
        assert out.get(timeout=TIMEOUT) == "written"
        assert t.tolist() == [1.0, 9.0, 9.0, 9.0]
        go.put(1)
        c.join(TIMEOUT)
        assert c.exitcode == 0
        assert ut.stats()["bundles"] == 1
    finally:
        for p in (b, c):
            if p.is_alive():
                p.kill()
