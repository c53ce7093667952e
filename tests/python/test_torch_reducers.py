"""usmipc.torch: torch.multiprocessing's reducers routed through usmipc.

On this machine there is no GPU: the routed path runs on CPU tensors over
usmipc host memory (which install() routes too: they are usmipc memory),
through the same message, bundle, ticket and rebuild code as CUDA tensors;
tests/gpu/test_gpu_torch_reducers.py and torch's own test_multiprocessing.py
(tests/gpu/torch_mp/) run the CUDA side on the GPU machine. CPU tensors of
torch's allocator must keep torch's own path.

The .pth switch (USMIPC_TORCH=1) is tested twice: with a stand-in torch
package (runs everywhere, the installed wheel included, where torch is
absent) and with torch itself through spawn and forkserver children.
"""

import gc
import json
import multiprocessing
import os
import pickle
import sys
import textwrap
import threading
import time

import pytest

import usmipc

from conftest import TIMEOUT, KeptSince, child_env, run_python

MUST_RUN = os.environ.get("CI") == "true" and \
    os.environ.get("USMIPC_TEST_INSTALLED") != "1"


def _need_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        if MUST_RUN:
            pytest.fail("torch is not installed (make distributed-deps); "
                        "CI must run these tests")
        pytest.skip("torch is not installed")
    import usmipc.torch as ut
    return torch, ut


@pytest.fixture
def routed():
    """torch and usmipc.torch, installed for the test and uninstalled
    after it."""
    torch, ut = _need_torch()
    ut.install()
    ut.reset_stats()
    try:
        yield torch, ut
    finally:
        ut.uninstall()


HOST = "host:cpu"


def host_tensor(torch, n, dtype=None):
    """A CPU tensor over usmipc host memory (n float32 unless dtype)."""
    from usmipc.memory import MemoryUSMDevice
    dtype = dtype or torch.float32
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    mem = MemoryUSMDevice(nbytes, device=usmipc.Device(HOST))
    return torch.from_dlpack(mem).view(dtype)


def spawn_with_queues(target, n):
    """Starts target(*queues) in a spawned process with n fresh queues;
    returns the queues, then the process."""
    ctx = multiprocessing.get_context("spawn")
    queues = [ctx.Queue() for _ in range(n)]
    p = ctx.Process(target=target, args=tuple(queues))
    p.start()
    return (*queues, p)


# ---- install / uninstall ---------------------------------------------------


def test_install_swaps_code_and_uninstall_restores():
    torch, ut = _need_torch()
    import multiprocessing.queues as queues
    from multiprocessing.reduction import ForkingPickler
    import torch.multiprocessing.reductions as red
    # Bound by name before install(): the same function objects.
    from torch.multiprocessing.reductions import reduce_tensor as bound
    before = (red.reduce_tensor.__code__, red.reduce_storage.__code__,
              ForkingPickler.__dict__["dumps"], queues.Queue.__dict__["put"],
              queues.JoinableQueue.__dict__["put"])
    ut.install()
    try:
        ut.install()  # idempotent
        assert ut.installed()
        assert red.reduce_tensor.__code__ is not before[0]
        assert red.reduce_storage.__code__ is not before[1]
        assert ForkingPickler.__dict__["dumps"] is not before[2]
        t = host_tensor(torch, 4)
        fn, args = bound(t)  # outside dumps: a bundle of its own
        assert fn is ut._rebuild_standalone
        assert fn(*args).data_ptr() == t.data_ptr()  # (its ticket back)
        assert bound(torch.zeros(3))[0] is red.rebuild_tensor  # torch's
    finally:
        ut.uninstall()
    assert not ut.installed()
    assert (red.reduce_tensor.__code__, red.reduce_storage.__code__,
            ForkingPickler.__dict__["dumps"], queues.Queue.__dict__["put"],
            queues.JoinableQueue.__dict__["put"]) == before
    assert "__usmipc_reduce_tensor" not in vars(red)
    assert bound(host_tensor(torch, 4))[0] is red.rebuild_tensor


def test_reinit_reductions_keeps_the_routing(routed):
    """torch.multiprocessing's init_reductions() (run again by a later
    import or reload of torch.multiprocessing) registers the same function
    objects: still routed."""
    torch, ut = routed
    import torch.multiprocessing.reductions as red
    from multiprocessing.reduction import ForkingPickler
    red.init_reductions()
    t = host_tensor(torch, 8)
    data = ForkingPickler.dumps([t, t[2:]])
    assert b"_open_message" in bytes(data)
    back = ForkingPickler.loads(data)
    assert back[0].data_ptr() == t.data_ptr()  # this process maps it once
    assert back[1].storage_offset() == 2
    assert ut.stats()["messages"] == 1 and ut.stats()["bundles"] == 1


def test_cpu_tensors_keep_torchs_path(routed):
    torch, ut = routed
    from multiprocessing.reduction import ForkingPickler
    t = torch.arange(6.0)
    data = bytes(ForkingPickler.dumps(t))
    assert b"usmipc" not in data and b"rebuild_storage_fd" in data
    assert ForkingPickler.loads(data).tolist() == t.tolist()
    assert ut.stats()["torch_tensors"] == 1
    assert ut.stats()["routed_tensors"] == 0
    # share() takes a torch storage whole (what the reducers send), and
    # refuses torch's own CPU memory as it refuses a CPU tensor.
    with pytest.raises(usmipc.MemoryKindError, match="CPU storage of "
                       "torch's own memory"):
        usmipc.share([t.untyped_storage()])
    s = host_tensor(torch, 6).untyped_storage()
    bundle = usmipc.share([s])
    leaf = usmipc.open_shared(bundle.to_bytes())[0]
    assert (leaf.dtype, leaf.shape, leaf.ptr) == ("uint8", (24,),
                                                  s.data_ptr())


class _CallRecorder(pickle.Unpickler):
    """Loads a lone message as the call it makes: ("_open_lone", *args)."""

    def find_class(self, module, name):
        if (module, name) == ("usmipc.torch", "_open_lone"):
            return lambda *args: ("_open_lone",) + args
        return super().find_class(module, name)


def test_the_c_lone_message_is_the_pythons(routed):
    """The one-tensor message written in C (_usmipc._torch_lone, the pickle
    opcodes written directly) is the call _lone_message's pickle makes:
    _open_lone with the same arguments (the bundle bytes aside: a new
    handoff each), for a whole tensor, a view with offset and stride, a
    transposed one, a 0-d tensor, float16, and sizes past 32 bits (LONG1);
    each loads to the tensor sent. What C declines is None: a Parameter, a
    tensor requiring grad, protocol 2."""
    import io
    from multiprocessing.reduction import ForkingPickler
    torch, ut = routed
    t = host_tensor(torch, 12)
    t.copy_(torch.arange(12.0))
    h = host_tensor(torch, 5, torch.float16).fill_(1.5)
    u = host_tensor(torch, 1, torch.uint8).fill_(7)
    cases = {"whole": t, "view": t[3:9:2], "transposed": t.view(3, 4).t(),
             "scalar": t[5:6].view(()), "half": h,
             "past 32 bits": u.expand(2 ** 33)}
    for what, x in cases.items():
        py = ut._lone_message(x, None, None)  # names the dtype, too
        before = ut.stats()
        c = ut._usmipc._torch_lone(x, None, None)
        after = ut.stats()
        assert py is not None and c is not None, what
        assert {k: after[k] - before[k] for k in after
                if after[k] != before[k]} == {
            "host_tensors": 1, "routed_tensors": 1, "bundles": 1,
            "messages": 1}, what
        assert type(c) is memoryview, what
        calls = [_CallRecorder(io.BytesIO(bytes(m))).load() for m in (py, c)]
        assert type(calls[1][2]) is bytes, what
        assert [k[:2] + k[3:] for k in calls] == [
            ("_open_lone", "cpu", 0, tuple(x.shape), x.stride(),
             x.storage_offset(), str(x.dtype)[6:], False)] * 2, what
        for m in (py, c):
            got = ForkingPickler.loads(m)
            assert (got.dtype, got.shape, got.stride(),
                    got.storage_offset()) == (x.dtype, x.shape, x.stride(),
                                              x.storage_offset()), what
            if x.numel() < 100:
                assert got.tolist() == x.tolist(), what
            else:
                assert (got[0].item(), got[-1].item()) == (7, 7), what
            del got
    p = torch.nn.Parameter(host_tensor(torch, 2))
    assert ut._usmipc._torch_lone(p, None, None) is None
    g = host_tensor(torch, 2).requires_grad_()
    assert ut._usmipc._torch_lone(g, None, None) is None
    assert ut._usmipc._torch_lone(t, None, 2) is None
    with pytest.raises(TypeError):
        ut._usmipc._torch_lone(t, None)


def test_non_leaf_requiring_grad_is_refused_as_torch_does(routed):
    torch, _ = routed
    from multiprocessing.reduction import ForkingPickler
    leaf = host_tensor(torch, 4).requires_grad_(True)
    with pytest.raises(RuntimeError, match="requires_grad"):
        ForkingPickler.dumps(leaf * 2)
    q = multiprocessing.get_context("spawn").SimpleQueue()
    with pytest.raises(RuntimeError, match="requires_grad"):
        q.put(leaf * 2)
    q.close()


# ---- across processes ------------------------------------------------------


def _receive_and_check(q, out):
    import torch
    data = q.get(timeout=TIMEOUT)
    t, v, p, s, i = data["t"], data["v"], data["p"], data["s"], data["i"]
    checks = {
        "shape": tuple(t.shape) == (16,),
        "view": (v.storage_offset(), v.stride(), tuple(v.shape)) ==
                (4, (2,), (6,)),
        "one storage": t.untyped_storage().data_ptr() ==
                       v.untyped_storage().data_ptr() == s.data_ptr(),
        "values": t.tolist() == [float(x) for x in range(16)],
        "parameter": type(p) is torch.nn.Parameter and p.requires_grad,
        "grad flag": t.requires_grad is False,
        "storage": type(s) is torch.UntypedStorage and s.nbytes() == 64,
        "int parameter": type(i) is torch.nn.Parameter and
                         not i.requires_grad and i.dtype == torch.int64,
    }
    t[0] = 42.0  # the sender sees it: the same memory
    out.put(checks)
    del data, t, v, p, s, i
    gc.collect()
    out.put("dropped")


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_queue_moves_views_parameters_and_storages(routed, method):
    torch, ut = routed
    from usmipc import memory
    kept_before = {id(b) for b in memory._kept_handles()}
    ctx = multiprocessing.get_context(method)
    base = host_tensor(torch, 16)
    base.copy_(torch.arange(16.0))
    ints = host_tensor(torch, 2, torch.int64)
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_receive_and_check, args=(q, out))
    p.start()
    q.put({"t": base, "v": base[4::2], "p": torch.nn.Parameter(base[:4]),
           "s": base.untyped_storage(),
           "i": torch.nn.Parameter(ints, requires_grad=False)})
    checks = out.get(timeout=TIMEOUT)
    assert checks == dict.fromkeys(checks, True)
    assert out.get(timeout=TIMEOUT) == "dropped"
    assert float(base[0]) == 42.0
    p.join(TIMEOUT)
    assert p.exitcode == 0
    st = ut.stats()
    # One message, one bundle: two allocations (base's, ints'), one event
    # and one ticket for the five objects.
    assert (st["messages"], st["bundles"], st["routed_tensors"],
            st["routed_storages"]) == (1, 1, 4, 1)
    deadline = time.monotonic() + TIMEOUT

    def ours():
        return [b for b in memory._kept_handles() if id(b) not in kept_before]

    while ours() and time.monotonic() < deadline:
        time.sleep(0.01)
    # The ticket came back when the child dropped its tensors.
    assert not ours()


def _load_write_report(conn):
    import torch  # noqa: F401  (the rebuild needs it; usmipc is imported)
    from multiprocessing.reduction import ForkingPickler
    data = conn.recv_bytes()
    t = ForkingPickler.loads(data)
    conn.send(t.tolist())
    t.add_(1)
    conn.send("written")
    conn.recv()


def test_forking_pickler_bytes_outside_a_queue(routed):
    """As SGLang's MultiprocessingSerializer: ForkingPickler.dumps in one
    process, the bytes over any channel, ForkingPickler.loads in another."""
    torch, ut = routed
    from multiprocessing.reduction import ForkingPickler
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_load_write_report, args=(child,))
    p.start()
    t = host_tensor(torch, 5)
    t.copy_(torch.tensor([1.0, 2, 3, 4, 5]))
    data = ForkingPickler.dumps(t[1:4])
    # What ForkingPickler.dumps returns without usmipc too: callers use
    # memoryview's methods (.tobytes(), .release()).
    assert type(data) is memoryview
    parent.send_bytes(data.tobytes())
    assert parent.recv() == [2.0, 3.0, 4.0]
    assert parent.recv() == "written"
    assert t.tolist() == [1.0, 3.0, 4.0, 5.0, 5.0]
    parent.send("bye")
    p.join(TIMEOUT)
    assert p.exitcode == 0


class _Registered:
    """A type given reducers through ForkingPickler.register after
    install(): dumps must use the latest one."""

    def __init__(self, tag):
        self.tag = tag


def _registered_a(obj):
    return (str, ("a:" + obj.tag,))


def _registered_b(obj):
    return (str, ("b:" + obj.tag,))


def test_dumps_follows_reducers_registered_later(routed):
    """usmipc's dumps keeps ForkingPickler's merged dispatch table between
    calls (its copy per dumps was 10% of a one-tensor dumps): a reducer
    registered, replaced or added through copyreg afterwards must be what
    the next dumps uses, as with torch's own ForkingPickler.dumps."""
    import copyreg
    import pickle
    from multiprocessing.reduction import ForkingPickler
    torch, _ = routed
    t = host_tensor(torch, 3)
    ForkingPickler.dumps(t)  # the merged table is made here
    ForkingPickler.register(_Registered, _registered_a)
    try:
        got = pickle.loads(ForkingPickler.dumps(_Registered("x")))
        assert got == "a:x"
        ForkingPickler._extra_reducers[_Registered] = _registered_b
        assert pickle.loads(ForkingPickler.dumps(_Registered("y"))) == "b:y"
    finally:
        ForkingPickler._extra_reducers.pop(_Registered, None)
    copyreg.pickle(_Registered, _registered_a)
    try:
        assert pickle.loads(ForkingPickler.dumps(_Registered("z"))) == "a:z"
    finally:
        copyreg.dispatch_table.pop(_Registered, None)
    # Gone again: plain pickling of the object, as without a reducer.
    assert pickle.loads(ForkingPickler.dumps(_Registered("w"))).tag == "w"


def test_a_lone_tensor_pickles_as_torchs_pickling_of_it(routed,
                                                       monkeypatch):
    """A message that is one tensor skips the pickler's dispatch: one
    routed tensor travels as a message of its own kind
    (usmipc.torch._lone_message), others have their reduction made and
    pickled directly (usmipc.torch._lone_body). What loads must be what
    pickling the tensor gives (a Parameter with requires_grad, a strided
    view with its offset, the whole tensor as it is, the non-leaf
    refusal), and a reducer registered for the tensor's type afterwards
    is what runs, as with torch's own ForkingPickler.dumps."""
    from multiprocessing.reduction import ForkingPickler
    torch, ut = routed
    t = host_tensor(torch, 10)
    t.copy_(torch.arange(10.0))
    taken = []
    lone, lone_message = ut._lone_body, ut._lone_message

    def spy(cls, obj, protocol):
        body = lone(cls, obj, protocol)
        taken.append("body" if body is not None else None)
        return body

    def spy_message(obj, put_event, protocol):
        out = lone_message(obj, put_event, protocol)
        if out is not None:
            taken.append("message")
        return out

    lone_c = ut._usmipc._torch_lone

    def spy_c(obj, put_event, protocol):
        out = lone_c(obj, put_event, protocol)
        if out is not None:
            taken.append("c")
        return out

    monkeypatch.setattr(ut, "_lone_body", spy)
    monkeypatch.setattr(ut, "_lone_message", spy_message)
    monkeypatch.setattr(ut._usmipc, "_torch_lone", spy_c)
    ut._dtype_names.pop(torch.bfloat16, None)  # not sent yet, as it were
    p = torch.nn.Parameter(t[2:6])
    got = ForkingPickler.loads(ForkingPickler.dumps(p))
    assert type(got) is torch.nn.Parameter and got.requires_grad
    assert got.tolist() == [2.0, 3.0, 4.0, 5.0]
    del got
    w = host_tensor(torch, 6, torch.bfloat16)
    w.copy_(torch.arange(6.0))
    # The first tensor of a dtype goes by the Python, which names the dtype;
    # the next by the C (a Parameter always by the Python).
    for _ in range(2):
        got = ForkingPickler.loads(ForkingPickler.dumps(w))
        assert (got.dtype, got.shape, got.tolist()) == (
            torch.bfloat16, (6,), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
        del got
    got = ForkingPickler.loads(ForkingPickler.dumps(w))
    assert taken == ["message", "message", "c", "c"]
    del taken[:]
    # A tensor of memory this process received (this one, loaded here):
    # handed on by the general path, its reduction pickled directly.
    v = ForkingPickler.loads(ForkingPickler.dumps(got[1:6:2]))
    assert (v.tolist(), v.stride(), v.storage_offset()) == ([1.0, 3.0, 5.0],
                                                           (2,), 1)
    assert taken == ["body"]
    del taken[:]
    leaf = host_tensor(torch, 4).requires_grad_()
    with pytest.raises(RuntimeError, match="requires_grad"):
        ForkingPickler.dumps(leaf * 2)
    # Not a tensor, or a tensor of a type with a reducer of its own: the
    # pickler's path, as before.
    assert pickle.loads(ForkingPickler.dumps([1, 2])) == [1, 2]
    saved = ForkingPickler._extra_reducers[torch.Tensor]
    ForkingPickler._extra_reducers[torch.Tensor] = _registered_mine
    try:
        assert pickle.loads(ForkingPickler.dumps(t)) == "mine"
    finally:
        ForkingPickler._extra_reducers[torch.Tensor] = saved
    # [1, 2] and the tensor with a reducer of its own: neither fast path.
    assert taken == [None, None]


def _registered_mine(obj):
    return (str, ("mine",))


def _get_twice(q, out):
    import usmipc.torch as ut
    a = q.get(timeout=TIMEOUT)
    b = q.get(timeout=TIMEOUT)
    out.put((a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr(),
             a.untyped_storage()._cdata == b.untyped_storage()._cdata,
             ut.stats()["reused_storages"]))


def test_a_storage_sent_twice_is_one_storage(routed):
    torch, _ = routed
    q, out, p = spawn_with_queues(_get_twice, 2)
    t = host_tensor(torch, 8)
    q.put(t)
    q.put(t[1:])
    assert out.get(timeout=TIMEOUT) == (True, True, 1)
    p.join(TIMEOUT)
    assert p.exitcode == 0


def test_a_whole_tensor_sent_twice_is_one_storage(routed):
    """The same whole tensor put twice (each a one-tensor message, loaded
    by _open_lone's own path) while the receiver holds the first: the
    second is a tensor over the first one's storage."""
    torch, _ = routed
    q, out, p = spawn_with_queues(_get_twice, 2)
    t = host_tensor(torch, 8)
    q.put(t)
    q.put(t)
    assert out.get(timeout=TIMEOUT) == (True, True, 1)
    p.join(TIMEOUT)
    assert p.exitcode == 0


def _read_later(q, out, go):
    t = q.get(timeout=TIMEOUT)
    out.put("got")
    go.get(timeout=TIMEOUT)
    out.put(t.tolist())


def test_memory_stays_while_the_receiver_holds_it(routed):
    """The sender drops every reference right after put(): the bundle it
    keeps until the ticket returns holds the memory."""
    torch, _ = routed
    q, out, go, p = spawn_with_queues(_read_later, 3)
    t = host_tensor(torch, 1024)
    t.copy_(torch.arange(1024.0))
    q.put(t)
    del t
    assert out.get(timeout=TIMEOUT) == "got"
    gc.collect()
    junk = [host_tensor(torch, 1024).fill_(-1) for _ in range(8)]  # reuse?
    go.put(1)
    assert out.get(timeout=TIMEOUT) == [float(x) for x in range(1024)]
    del junk
    p.join(TIMEOUT)


def _process_arg(t, out):
    out.put(t.tolist())
    t.fill_(7)


def test_process_arguments_travel_as_usmipc_memory(routed):
    """A spawned Process's arguments are pickled by reduction.dump, not
    ForkingPickler.dumps: each tensor is a bundle of its own."""
    torch, ut = routed
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    t = host_tensor(torch, 3)
    t.copy_(torch.tensor([1.0, 2.0, 3.0]))
    p = ctx.Process(target=_process_arg, args=(t, out))
    p.start()
    assert out.get(timeout=TIMEOUT) == [1.0, 2.0, 3.0]
    p.join(TIMEOUT)
    assert p.exitcode == 0
    assert t.tolist() == [7.0, 7.0, 7.0]
    assert ut.stats()["standalone"] == 1


def _forwarder(q, hop, out):
    """B: receives t, hands a view of it on to C through hop (a message),
    then a Process argument (reduction.dump: standalone), then drops
    everything it received."""
    import torch.multiprocessing as tmp
    import usmipc.torch
    usmipc.torch.install()
    t = q.get(timeout=TIMEOUT)
    hop.put(t[1:])
    c = tmp.get_context("spawn").Process(target=_arg_reader, args=(t, out))
    c.start()
    c.join(TIMEOUT)
    stats = usmipc.torch.stats()
    out.put((stats["forwarded"], stats["bundles"], c.exitcode))
    del t
    q.get(timeout=TIMEOUT)


def _arg_reader(t, out):
    out.put(("arg", t.tolist()))


def _hop_reader(hop, out, go):
    """C: reads the view B handed on, and writes into it when told: the
    first sender's memory."""
    import usmipc.torch
    usmipc.torch.install()
    t = hop.get(timeout=TIMEOUT)
    out.put(("hop", t.tolist()))
    go.get(timeout=TIMEOUT)
    t.fill_(9)
    out.put("written")
    go.get(timeout=TIMEOUT)


def _start_forward_chain():
    """B (_forwarder) and C (_hop_reader), started, and their queues:
    q (A to B), hop (B to C), out (to A), go (A to C)."""
    ctx = multiprocessing.get_context("spawn")
    q, hop, out, go = (ctx.Queue() for _ in range(4))
    b = ctx.Process(target=_forwarder, args=(q, hop, out))
    c = ctx.Process(target=_hop_reader, args=(hop, out, go))
    b.start()
    c.start()
    return (q, hop, out, go), (b, c)


def test_a_received_tensor_is_sent_on_as_the_first_handoff(routed):
    """A puts t to B; B puts a view of it to C (a queue message) and passes
    it to a Process (its arguments): neither is a copy or a new export, C
    writes into A's memory, and A's tensor sees it."""
    torch, ut = routed
    (q, hop, out, go), (b, c) = _start_forward_chain()
    try:
        t = host_tensor(torch, 4)
        t.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        q.put(t)
        got = sorted([out.get(timeout=TIMEOUT) for _ in range(3)], key=str)
        assert got[0] == ("arg", [1.0, 2.0, 3.0, 4.0])
        assert got[1] == ("hop", [2.0, 3.0, 4.0])
        forwarded, bundles, exitcode = got[2]
        assert (forwarded, bundles, exitcode) == (2, 0, 0)
        q.put("done")  # B drops what it received and exits
        b.join(TIMEOUT)
        assert b.exitcode == 0
        go.put(1)  # C writes after B is gone: A's memory, still held
        assert out.get(timeout=TIMEOUT) == "written"
        assert t.tolist() == [1.0, 9.0, 9.0, 9.0]
        go.put(1)
        c.join(TIMEOUT)
        assert c.exitcode == 0
        assert ut.stats()["bundles"] == 1  # A exported once
    finally:
        for p in (b, c):
            if p.is_alive():
                p.kill()


def test_the_first_sender_frees_once_forwarder_and_next_receiver_exit(
        routed):
    """A puts t to B, B hands it on to C and to a Process argument, then
    every one of them exits: A's bundle has every ticket back, and A drops
    it (its memory is not held until A exits). Before, the Process
    argument's ticket never came back: multiprocessing keeps the child's
    Process object, and so the tensor, to the very end, and a ticket held
    at exit was never returned (releases stayed (3, 2))."""
    torch, ut = routed
    kept = KeptSince()
    (q, hop, out, go), (b, c) = _start_forward_chain()
    try:
        t = host_tensor(torch, 4)
        q.put(t)
        for _ in range(3):
            out.get(timeout=TIMEOUT)
        q.put("done")
        b.join(TIMEOUT)
        go.put(1)
        assert out.get(timeout=TIMEOUT) == "written"
        go.put(1)
        c.join(TIMEOUT)
        assert (b.exitcode, c.exitcode) == (0, 0)
        assert [h.releases for h in kept.after_waiting()] == []
    finally:
        for p in (b, c):
            if p.is_alive():
                p.kill()


def _hold_until_exit(q, out):
    """A fork child that keeps what it received in a global and leaves
    (by os._exit, after multiprocessing's finalizers)."""
    global _held
    _held = q.get(timeout=TIMEOUT)
    out.put(_held.tolist())


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_receiver_that_exits_holding_a_tensor_returns_its_ticket(
        routed, method):
    """A receiver that still holds a received tensor when it ends gives its
    ticket back as it exits (atexit, and multiprocessing's finalizers in
    fork and forkserver children), so the sender frees the memory then,
    not when it exits itself."""
    torch, ut = routed
    ctx = multiprocessing.get_context(method)
    q, out = ctx.Queue(), ctx.Queue()
    kept = KeptSince()
    p = ctx.Process(target=_hold_until_exit, args=(q, out))
    p.start()
    t = host_tensor(torch, 3)
    t.copy_(torch.tensor([1.0, 2.0, 3.0]))
    q.put(t)
    assert out.get(timeout=TIMEOUT) == [1.0, 2.0, 3.0]
    p.join(TIMEOUT)
    assert p.exitcode == 0
    assert [h.releases for h in kept.after_waiting()] == []


SENDER_EXITS = """
import os, sys, torch, usmipc, usmipc.torch
from multiprocessing.connection import Client
from multiprocessing.reduction import ForkingPickler
from usmipc.memory import MemoryUSMDevice
usmipc.torch.install()
mem = MemoryUSMDevice(4096, device=usmipc.Device("host:cpu"))
t = torch.from_dlpack(mem).view(torch.int32)
t.copy_(torch.arange(1024, dtype=torch.int32))
c = Client(sys.argv[1], authkey=b"k")
c.send_bytes(ForkingPickler.dumps(t))
c.recv()  # the receiver has it: exit at once
"""


def test_receiver_keeps_reading_after_the_sender_exits(routed, tmp_path):
    """fd memory (usmipc host memory here; CUDA expandable segments and
    usmipc's allocator on the GPU) outlives its exporter once mapped; the
    sender exits without a word on stderr."""
    torch, _ = routed
    import subprocess
    from multiprocessing.connection import Listener
    from multiprocessing.reduction import ForkingPickler
    addr = str(tmp_path / "sock")
    with Listener(addr, authkey=b"k") as lst:
        proc = subprocess.Popen([sys.executable, "-c", SENDER_EXITS, addr],
                                stderr=subprocess.PIPE)
        conn = lst.accept()
        t = ForkingPickler.loads(conn.recv_bytes())
        conn.send("got")
        _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0
    assert err.decode().strip() == ""
    assert t.tolist() == list(range(1024))
    t.add_(1)  # still mapped, still writable
    assert int(t[-1]) == 1024


SENDER_GONE = SENDER_EXITS.replace('c.recv()  # the receiver has it: exit '
                                   'at once', 'c.close()')


def test_a_message_loaded_after_the_sender_exited_says_what_to_do(
        routed, tmp_path):
    torch, _ = routed
    import subprocess
    from multiprocessing.connection import Listener
    from multiprocessing.reduction import ForkingPickler
    addr = str(tmp_path / "sock")
    with Listener(addr, authkey=b"k") as lst:
        proc = subprocess.Popen([sys.executable, "-c", SENDER_GONE, addr])
        data = lst.accept().recv_bytes()
        assert proc.wait(timeout=TIMEOUT) == 0
    with pytest.raises(usmipc.Error, match=r"has exited.*usmipc\.torch: the "
                       r"sender is gone.*expandable_segments:True") as info:
        ForkingPickler.loads(data)
    assert info.value.name == "USMIPC_EEXPORTERGONE"


def _load_twice_report(conn):
    """Loads the message, drops what it got, then loads the same bytes
    until the sender has freed them (its ticket came back): reports the
    second load's error."""
    from multiprocessing.reduction import ForkingPickler
    import usmipc.torch  # noqa: F401
    data = conn.recv_bytes()
    t = ForkingPickler.loads(data)
    del t
    gc.collect()
    deadline = time.monotonic() + TIMEOUT
    said = None
    while said is None and time.monotonic() < deadline:
        try:
            again = ForkingPickler.loads(data)
        except usmipc.Error as e:
            said = (e.name, str(e))
        else:
            del again
            gc.collect()
            time.sleep(0.05)
    conn.send(said)
    conn.recv()


@pytest.mark.parametrize("lone", [True, False])
def test_a_message_loaded_again_after_its_release_says_so(routed, lone):
    """A message is one handoff: once loaded and dropped, its sender frees
    it, and loading the same bytes again fails saying that, not that the
    sender is gone (it is alive)."""
    from multiprocessing.reduction import ForkingPickler
    torch, _ = routed
    t = host_tensor(torch, 8)
    data = ForkingPickler.dumps(t if lone else {"a": t, "b": t[2:4]})
    name, text = _report_of_child(_load_twice_report, data)
    assert name == "USMIPC_EEXPORTERGONE"
    assert "the sender is gone" not in text, text
    assert "loaded once" in text and "dumps it again" in text, text


# ---- the switch: USMIPC_TORCH=1 through usmipc-torch.pth -------------------

FAKE_TORCH = {
    "torch/__init__.py": "from torch import multiprocessing\n",
    "torch/multiprocessing/__init__.py":
        "from torch.multiprocessing import reductions\n"
        "reductions.init_reductions()\n",
    "torch/multiprocessing/reductions.py": textwrap.dedent("""
        INIT = []
        def reduce_tensor(tensor):
            return "torch's own"
        def reduce_storage(storage):
            return "torch's own"
        def init_reductions():
            INIT.append(1)
        """),
}

HOOK_PROBE = """
import sys
before = {m for m in ("usmipc", "torch") if m in sys.modules}
import torch
import torch.multiprocessing.reductions as red
print(sorted(before), red.INIT,
      red.reduce_tensor.__code__.co_filename,
      "usmipc" in sys.modules, "usmipc.torch" in sys.modules)
"""


def _site_has_pth():
    import sysconfig
    return os.path.exists(os.path.join(sysconfig.get_paths()["purelib"],
                                       "usmipc-torch.pth"))


@pytest.fixture
def fake_torch(tmp_path):
    if not _site_has_pth():
        pytest.skip("usmipc-torch.pth is not in this interpreter's "
                    "site-packages (usmipc is not installed: make python)")
    for name, text in FAKE_TORCH.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_switch_off_imports_nothing(fake_torch):
    env = child_env(PYTHONPATH=fake_torch)
    env.pop("USMIPC_TORCH", None)
    r = run_python(HOOK_PROBE, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().split() == \
        ["[]", "[1]", "/".join([fake_torch, "torch/multiprocessing/"
                                "reductions.py"]), "False", "False"]
    r = run_python(HOOK_PROBE, env=dict(env, USMIPC_TORCH="0"))
    assert r.stdout.decode().split()[-2:] == ["False", "False"]


def test_switch_on_installs_at_the_first_import(fake_torch):
    """Nothing is imported at start (not torch, not usmipc: the .pth line
    imports only the hook, a finder of 80 lines); the first
    import of torch.multiprocessing runs torch's module, then install()."""
    r = run_python(HOOK_PROBE,
                   env=child_env(PYTHONPATH=fake_torch, USMIPC_TORCH="1"))
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode().split()
    assert out[0] == "[]" and out[1] == "[1]"
    assert out[2:] == ["<usmipc.torch:", "reduce_tensor>", "True", "True"]


SWITCH_PARENT = """
import multiprocessing, sys, torch
import usmipc.torch as ut
from usmipc.memory import MemoryUSMDevice
import usmipc

def child(q, out):
    import usmipc.torch as ut
    t = q.get(timeout=60)
    out.put((ut.installed(), t.tolist()))

if __name__ == "__main__":
    assert ut.installed(), "the switch did not install"
    mem = MemoryUSMDevice(16, device=usmipc.Device("host:cpu"))
    t = torch.from_dlpack(mem).view(torch.float32)
    t.fill_(3)
    for method in ("spawn", "forkserver"):
        ctx = multiprocessing.get_context(method)
        q, out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=child, args=(q, out))
        p.start()
        q.put(t)
        print(method, out.get(timeout=60))
        p.join(60)
"""


def test_switch_reaches_spawn_and_forkserver_children(tmp_path):
    _need_torch()
    if not _site_has_pth():
        pytest.skip("usmipc-torch.pth is not installed (make python)")
    script = tmp_path / "parent.py"
    script.write_text(SWITCH_PARENT)
    stats = tmp_path / "stats"
    import subprocess
    r = subprocess.run([sys.executable, str(script)], capture_output=True,
                       timeout=3 * TIMEOUT,
                       env=child_env(USMIPC_TORCH="1",
                                     USMIPC_TORCH_STATS=str(stats)))
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().splitlines()
    assert lines == ["spawn (True, [3.0, 3.0, 3.0, 3.0])",
                     "forkserver (True, [3.0, 3.0, 3.0, 3.0])"]
    # Each process that installed wrote its counters at exit: the parent
    # routed two tensors, each child received one (the forkserver server
    # itself installs too, and sends nothing).
    records = [json.loads(p.read_text()) for p in stats.iterdir()]
    parent = [x for x in records if x["routed_tensors"]]
    children = [x for x in records if x["received_tensors"]]
    assert len(parent) == 1 and parent[0]["routed_tensors"] == 2
    assert parent[0]["messages"] == 2
    assert len(children) == 2
    assert all(c["received_tensors"] == 1 for c in children)


def test_plain_pickle_is_untouched(routed):
    """pickle.dumps (not ForkingPickler) of a tensor over usmipc memory is
    torch's copy, as before."""
    torch, _ = routed
    t = host_tensor(torch, 4).fill_(5)
    data = pickle.dumps(t)
    assert b"usmipc" not in data
    assert pickle.loads(data).tolist() == [5.0] * 4


def test_a_refused_message_goes_by_torchs_path(routed, monkeypatch):
    """When usmipc refuses the memory (MemoryKindError, ENOTSUP...), the
    message is pickled again by torch's own reductions, with one warning;
    nothing of the refused attempt stays kept by the sender."""
    torch, ut = routed
    from multiprocessing.reduction import ForkingPickler
    from usmipc import memory
    t = host_tensor(torch, 4).fill_(2)
    kept = len(memory._kept_handles())

    def refuse(*args, **kwargs):
        raise usmipc.MemoryKindError("refused for the test")

    # Both ways a message's bundle is made: from the message's records
    # (_TorchMessage.share) and from its storages (usmipc.share).
    monkeypatch.setattr(ut, "_share_group", refuse)
    with pytest.warns(RuntimeWarning, match="travels by torch's own CUDA "
                      "IPC instead"):
        data = bytes(ForkingPickler.dumps({"a": t, "b": t[1:]}))
    monkeypatch.undo()
    assert b"_open_message" not in data and b"rebuild_storage_fd" in data
    assert len(memory._kept_handles()) == kept
    assert ut.stats()["fallbacks"] == 1 and ut.stats()["messages"] == 0
    back = ForkingPickler.loads(data)
    assert back["a"].tolist() == [2.0] * 4


@pytest.fixture
def nothing_received(routed):
    """usmipc.torch's record of what this process received, emptied for
    the test (other tests loaded messages here): a sender that never
    received, whose tensors the C step reduces; put back after."""
    _, ut = routed
    saved = dict(ut._received)
    ut._received.clear()
    try:
        yield
    finally:
        ut._received.update(saved)


def _messages_made(monkeypatch, ut):
    made = []

    def make(put_event):
        m = usmipc._usmipc._TorchMessage(put_event)
        made.append(m)
        return m

    monkeypatch.setattr(ut, "_Message", make)
    return made


def _report_of_child(target, data):
    """What target(conn) reports of the message data in a spawned process,
    which then exits cleanly."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child,))
    proc.start()
    parent.send_bytes(data.tobytes())
    got = parent.recv()
    parent.send("bye")
    proc.join(TIMEOUT)
    assert proc.exitcode == 0
    return got


def _load_dict_report(conn):
    from multiprocessing.reduction import ForkingPickler
    import usmipc.torch  # noqa: F401 (the receiver needs no install())
    d = ForkingPickler.loads(conn.recv_bytes())
    a, b, c, p = d["a"], d["b"], d["c"], d["p"]
    conn.send({
        "a": a.tolist(), "b": b.tolist(), "c": c.tolist(),
        "b_offset": b.storage_offset(), "b_stride": b.stride(),
        "one_storage": a.untyped_storage()._cdata
        == b.untyped_storage()._cdata,
        "p": (type(p).__name__, p.requires_grad, p.tolist()),
        "tied": d["tied"] is d["a"]})
    conn.recv()


def test_the_c_step_takes_a_messages_tensors(routed, nothing_received,
                                             monkeypatch):
    """A message of many tensors is reduced by the C step
    (python/usmipc/_ext/torch_reduce.c) with _reduce_tensor's rules: two
    views of one storage arrive as views of one storage (offset and stride
    kept), a Parameter with requires_grad as a Parameter, the same tensor
    twice as one object; what the step declines (a non-leaf requiring grad)
    is _reduce_tensor's refusal, in torch's words."""
    from multiprocessing.reduction import ForkingPickler
    torch, ut = routed
    made = _messages_made(monkeypatch, ut)
    t = host_tensor(torch, 8)
    t.copy_(torch.arange(8.0))
    c = host_tensor(torch, 3, torch.bfloat16)
    c.copy_(torch.tensor([7.0, 8.0, 9.0]))
    w = host_tensor(torch, 2)
    w.copy_(torch.tensor([0.5, 1.5]))
    p = torch.nn.Parameter(w)
    before = ut.stats()
    data = ForkingPickler.dumps({"a": t, "b": t[1:7:2], "c": c, "p": p,
                                 "tied": t})
    after = ut.stats()
    assert [m.taken for m in made] == [4]  # t once (memoized), b, c, p
    assert after["routed_tensors"] - before["routed_tensors"] == 4
    assert after["host_tensors"] - before["host_tensors"] == 4
    assert after["bundles"] - before["bundles"] == 1
    got = _report_of_child(_load_dict_report, data)
    assert got == {"a": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
                   "b": [1.0, 3.0, 5.0], "c": [7.0, 8.0, 9.0],
                   "b_offset": 1, "b_stride": (2,), "one_storage": True,
                   "p": ("Parameter", True, [0.5, 1.5]), "tied": True}
    leaf = host_tensor(torch, 4).requires_grad_()
    with pytest.raises(RuntimeError, match="requires_grad"):
        ForkingPickler.dumps({"ok": t, "bad": leaf * 2})
    assert made[-1].taken == 1  # "ok"; "bad" went to _reduce_tensor


def test_counts_of_the_c_steps_are_folded_where_stats_are_read(routed):
    """The C steps count into their own counters, which stats() and
    reset_stats() add to the counts dict first: stats() right after a dumps
    shows its tensors; reset_stats() drops them (none show up later), as it
    drops the Python side's counts."""
    from multiprocessing.reduction import ForkingPickler
    torch, ut = routed
    ts = {f"t{i}": host_tensor(torch, 4) for i in range(5)}
    ForkingPickler.dumps(ts)
    got = ut.stats()
    assert (got["host_tensors"], got["routed_tensors"], got["bundles"],
            got["messages"]) == (5, 5, 1, 1), got
    ForkingPickler.dumps(ts)
    ut.reset_stats()
    got = ut.stats()
    assert all(v == 0 for k, v in got.items() if k != "usmipc"), got
    ForkingPickler.dumps(ts["t0"])  # the one-tensor message, counted in C
    got = ut.stats()
    assert (got["host_tensors"], got["routed_tensors"], got["messages"]) == \
        (1, 1, 1), got


def _load_shapes_report(conn):
    from multiprocessing.reduction import ForkingPickler
    import usmipc.torch  # noqa: F401 (the receiver needs no install())
    d = ForkingPickler.loads(conn.recv_bytes())
    conn.send({k: (str(v.dtype), tuple(v.shape), v.stride(),
                   v.storage_offset(), type(v).__name__, v.tolist())
               for k, v in d.items()})
    conn.recv()


def test_a_messages_bundle_is_made_from_its_records(routed, nothing_received,
                                                    monkeypatch):
    """The bundle of a message is made from what the C step recorded of
    each storage when it reduced the tensor (_TorchMessage.share), with no
    second read of any tensor by usmipc.share: a storage one tensor covers
    whole travels as that tensor (its dtype and shape: 0-d, size-1 dims,
    a Parameter), any other as its bytes (two tensors over it, a dtype that
    does not travel as itself, more dimensions than a bundle holds), and
    the receiver gets every tensor as it was."""
    from multiprocessing.reduction import ForkingPickler
    torch, ut = routed
    made = _messages_made(monkeypatch, ut)

    def no_second_read(*args, **kwargs):
        raise AssertionError("usmipc.share() read the message's tensors again")

    monkeypatch.setattr(ut._usmipc, "share", no_second_read)
    scalar = host_tensor(torch, 1).view(())
    scalar.fill_(3.5)
    cube = host_tensor(torch, 24).view(2, 1, 12)
    cube.copy_(torch.arange(24.0).view(2, 1, 12))
    p = torch.nn.Parameter(host_tensor(torch, 2).fill_(0.25))
    t = host_tensor(torch, 8)
    t.copy_(torch.arange(8.0))
    u16 = host_tensor(torch, 3, torch.uint16)
    u16.copy_(torch.tensor([1, 2, 65535], dtype=torch.int32).to(torch.uint16))
    deep = host_tensor(torch, 1).view((1,) * 33).fill_(9.0)
    msg = {"scalar": scalar, "cube": cube, "p": p, "t": t, "t2": t[2:6],
           "u16": u16, "deep": deep}
    data = ForkingPickler.dumps(msg)
    assert [m.taken for m in made] == [7]
    # The records, as the bundle carries them.
    again = made[0].share(0)
    leaves = usmipc.open_shared(again.to_bytes())
    assert [(x.dtype, x.shape) for x in leaves] == [
        ("float32", ()), ("float32", (2, 1, 12)), ("float32", (2,)),
        ("uint8", (32,)), ("uint8", (6,)), ("uint8", (4,))]
    assert leaves[1].strides == (48, 48, 4)
    usmipc.close_shared(leaves)
    del again
    got = _report_of_child(_load_shapes_report, data)
    for k, v in msg.items():
        assert got[k] == (str(v.dtype), tuple(v.shape), v.stride(),
                          v.storage_offset(), type(v).__name__, v.tolist()), k


class _DumpsInside:
    """An object whose pickling pickles a tensor message of its own (a
    dumps inside a dumps): each message keeps its own tensors."""

    def __init__(self, t):
        self.t = t

    def __reduce__(self):
        from multiprocessing.reduction import ForkingPickler
        return (bytes, (ForkingPickler.dumps({"inner": self.t}).tobytes(),))


def test_the_c_step_follows_nested_messages_and_threads(
        routed, nothing_received, monkeypatch):
    from multiprocessing.reduction import ForkingPickler
    torch, ut = routed
    made = _messages_made(monkeypatch, ut)
    a, b = host_tensor(torch, 4), host_tensor(torch, 6)
    ForkingPickler.dumps({"a": a, "x": _DumpsInside(b), "a2": a[1:]})
    outer, inner = made
    # Each tensor in the message being pickled when it was reduced.
    assert (outer.taken, inner.taken) == (2, 1)
    assert [len(g.views) for g in outer.groups] == [1]
    assert [len(g.views) for g in inner.groups] == [1]
    # Threads: each thread's messages are its own.
    del made[:]
    errors = []

    def send(n):
        try:
            for _ in range(n):
                ForkingPickler.dumps({"a": a, "b": b})
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=send, args=(50,)) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT)
    assert not errors
    assert len(made) == 200 and all(m.taken == 2 for m in made)
    assert all(len(m.groups) == 1 and len(m.groups[0].views) == 2
               for m in made)


def test_the_c_step_refuses_what_is_not_its_own():
    from usmipc import _usmipc
    with pytest.raises(TypeError, match="_TorchMessage or None"):
        _usmipc._torch_push(object())
    with pytest.raises(ValueError, match="no Group"):
        _usmipc._torch_setup({})
    with pytest.raises(TypeError, match="a dict"):
        _usmipc._torch_setup([])


def test_the_c_step_hands_received_memory_to_python(routed,
                                                    nothing_received,
                                                    monkeypatch):
    """In a process that received a tensor and holds it, a message with
    that tensor and one of its own: the C step takes its own tensor, and
    the received one goes by _reduce_tensor, which hands it on (a _Forward
    group) instead of exporting another process's memory as its own."""
    from multiprocessing.reduction import ForkingPickler
    torch, ut = routed
    t = host_tensor(torch, 4)
    t.copy_(torch.arange(4.0))
    got = ForkingPickler.loads(ForkingPickler.dumps(t))  # received here
    assert ut._received
    own = host_tensor(torch, 3)
    made = _messages_made(monkeypatch, ut)
    data = ForkingPickler.dumps({"own": own, "fwd": got})
    (m,) = made
    assert m.taken == 1
    kinds = sorted(type(g).__name__ for g in m.groups)
    assert kinds == ["_Forward", "_Group"]
    back = ForkingPickler.loads(data)
    assert back["fwd"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.fixture
def slow_rebuilds(routed):
    """The receiver's C step (torch_rebuild.c) set up with a spy as its
    slow path: the list of `at`s it handed to torch.py's _rebuild_slow.
    The real set-up is put back after."""
    torch, ut = routed
    ut._bind_torch()
    handed = []

    def spy(at, *rest):
        handed.append(at)
        return ut._rebuild_slow(at, *rest)

    def setup(**over):
        config = {"tls": ut._tls, "received": ut._received,
                  "counts": ut._counts, "Tensor": torch.Tensor,
                  "empty": torch.empty, "UntypedStorage": torch.UntypedStorage,
                  "slow": spy, "prune": ut._prune_received,
                  "prune_at": ut._RECEIVED_PRUNE}
        config.update(over)
        usmipc._usmipc._torch_rebuild_setup(config)

    setup()
    try:
        yield handed, setup
    finally:
        ut._bind_torch()


def test_the_receivers_c_step_rebuilds_as_torch_does(routed, nothing_received,
                                                     slow_rebuilds):
    """A message's tensors are rebuilt by the C step where they are plain
    (the sender's whole tensor: the leaf itself; a view of a storage the
    message made already: a tensor over it) and by _rebuild_slow otherwise
    (a Parameter, requires_grad, a first view that is not the whole
    storage), each as torch rebuilds it; a storage this process still
    holds is the one storage both arrivals share."""
    from multiprocessing.reduction import ForkingPickler
    torch, ut = routed
    handed, _ = slow_rebuilds
    t = host_tensor(torch, 8)
    t.copy_(torch.arange(8.0))
    m = host_tensor(torch, 6).view(2, 3)
    m.copy_(torch.arange(6.0).view(2, 3))
    w = host_tensor(torch, 2)
    w.copy_(torch.tensor([0.5, 1.5]))
    r = host_tensor(torch, 2).requires_grad_()
    msg = {"a": t, "b": t[1:7:2], "mt": m.t(), "m": m,
           "p": torch.nn.Parameter(w), "r": r, "tied": t}
    before = ut.stats()
    got = ForkingPickler.loads(ForkingPickler.dumps(msg))
    after = ut.stats()
    assert got["a"].tolist() == t.tolist()
    assert (got["b"].storage_offset(), got["b"].stride()) == (1, (2,))
    assert got["b"].tolist() == [1.0, 3.0, 5.0]
    assert got["b"].untyped_storage()._cdata == \
        got["a"].untyped_storage()._cdata
    assert got["mt"].stride() == (1, 3) and got["mt"].tolist() == \
        m.t().tolist()
    assert got["m"].tolist() == m.tolist()
    assert got["m"].untyped_storage()._cdata == \
        got["mt"].untyped_storage()._cdata
    assert type(got["p"]) is torch.nn.Parameter and got["p"].requires_grad
    assert got["p"].tolist() == [0.5, 1.5]
    assert got["r"].requires_grad and got["tied"] is got["a"]
    # t and m travel as their storages' bytes (two tensors of the message
    # view each), so their first tensors (a, mt) went by the Python, which
    # makes the storage, as did p and r; C made b and m over those storages.
    assert handed == [(0, 0), (0, 1), (0, 2), (0, 3)], handed
    assert after["received_tensors"] - before["received_tensors"] == 6
    # Received again while held: the same storage, reused.
    again = ForkingPickler.loads(ForkingPickler.dumps({"a": t, "m": m}))
    assert again["a"].untyped_storage()._cdata == \
        got["a"].untyped_storage()._cdata
    assert again["m"].untyped_storage()._cdata == \
        got["m"].untyped_storage()._cdata
    assert ut.stats()["reused_storages"] - after["reused_storages"] == 2
    # Dropped, then received: fresh, and filed once per memory.
    del got, again
    gc.collect()
    fresh = ForkingPickler.loads(ForkingPickler.dumps(t))
    assert fresh.tolist() == t.tolist()
    key = (None, fresh.data_ptr(), fresh.untyped_storage().nbytes())
    assert key in ut._received
    assert not torch.UntypedStorage._expired(ut._received[key][0])


def test_the_receivers_c_step_prunes_what_died(routed, nothing_received,
                                               slow_rebuilds):
    """_received is pruned of dead storages when it reaches prune_at, by
    the C step calling _prune_received; the live entries stay."""
    from multiprocessing.reduction import ForkingPickler
    torch, ut = routed
    _, setup = slow_rebuilds
    pruned = []

    def prune():
        pruned.append(len(ut._received))
        ut._prune_received()

    setup(prune=prune, prune_at=3)
    kept = host_tensor(torch, 4)
    held = ForkingPickler.loads(ForkingPickler.dumps({"k": kept}))
    for i in range(3):  # sizes apart: each its own key
        x = ForkingPickler.loads(ForkingPickler.dumps({"x": host_tensor(
            torch, 5 + i)}))
        del x
        gc.collect()
    assert pruned and pruned[0] == 3, pruned
    assert len(ut._received) < 3
    live = (None, held["k"].data_ptr(), 16)
    assert live in ut._received


def test_the_receivers_c_step_refuses_bad_input(routed):
    from usmipc import _usmipc
    torch, ut = routed
    with pytest.raises(ValueError, match="_torch_rebuild_setup: no "):
        _usmipc._torch_rebuild_setup({})
    with pytest.raises(ValueError, match="no tls"):
        _usmipc._torch_rebuild_setup({"prune_at": 1})
    with pytest.raises(ValueError, match="prune_at, a count > 0"):
        _usmipc._torch_rebuild_setup({"prune_at": 0})
    with pytest.raises(TypeError, match="received and counts are dicts"):
        _usmipc._torch_rebuild_setup({"received": [], "prune_at": 1})
    with pytest.raises(TypeError, match="a dict"):
        _usmipc._torch_rebuild_setup([])
    with pytest.raises(TypeError, match="leaf, origin"):
        _usmipc._torch_storage_or_live(1)
    with pytest.raises(usmipc.Error, match="outside its message"):
        ut._rebuild_tensor((0, 0), torch.Tensor, (1,), (1,), 0,
                           torch.float32, False)
    with pytest.raises(TypeError):
        ut._rebuild_tensor((0, 0))


def test_the_receivers_c_step_hands_a_malformed_message_to_python(routed):
    """A message being loaded whose object lacks what C reads (no
    .storages) goes to _rebuild_slow, which says what is wrong in its own
    words (an AttributeError), with no exception left pending."""
    torch, ut = routed
    ut._bind_torch()

    class Bare:
        pass

    stack = ut._tls.__dict__.setdefault("opened", [])
    stack.append(Bare())
    try:
        with pytest.raises(AttributeError, match="storages"):
            ut._rebuild_tensor((0, 0), torch.Tensor, (1,), (1,), 0,
                               torch.float32, False)
    finally:
        stack.pop()
