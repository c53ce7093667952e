"""usmipc.share / open_shared / close_shared on host memory: nested trees of
mixed dtypes, strided views and zero-size arrays, opened by a process of
its own, written back, re-shared at the cost of metadata, refused once the
producer drops the bundle; bad input refused with errors that say where."""

import gc
import multiprocessing
import os
import pickle

import numpy as np
import pytest

import usmipc
from usmipc.memory import MemoryPool, MemoryUSMDevice

from conftest import TIMEOUT, probe_exception, reseal

HOST = "host:cpu"


def _arrays(pool):
    """A state-dict-like tree of numpy views over pool blocks."""
    f32 = np.from_dlpack(pool.allocate(4000)).view(np.float32)
    f32[:] = np.arange(1000, dtype=np.float32)
    i64 = np.from_dlpack(pool.allocate(512)).view(np.int64)
    i64[:] = np.arange(64)
    f16 = np.from_dlpack(pool.allocate(64)).view(np.float16)
    f16[:] = 1.5
    flags = np.from_dlpack(pool.allocate(7)).view(np.bool_)
    flags[:] = [True, False, True, True, False, False, True]
    c64 = np.from_dlpack(pool.allocate(16 * 8)).view(np.complex64)
    c64[:] = np.arange(16) * (1 + 2j)
    return {
        "embed": f32.reshape(10, 100),
        "layers": [
            {"w": i64.reshape(8, 8)[::2, 1::3], "b": f16[:5]},
            (flags, c64.reshape(4, 4).T),
        ],
        "empty": f16[:0].reshape(0, 3),
        "scalar": i64[5:6].reshape(()),
        "ключ": f32[10:20],
    }


def _expected(tree):
    if isinstance(tree, dict):
        return {k: _expected(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_expected(v) for v in tree)
    return np.array(tree)  # a copy


def _same(opened, expected):
    if isinstance(expected, dict):
        assert isinstance(opened, dict) and list(opened) == list(expected)
        for k in expected:
            _same(opened[k], expected[k])
    elif isinstance(expected, (list, tuple)):
        assert type(opened) is type(expected) and len(opened) == len(expected)
        for a, b in zip(opened, expected):
            _same(a, b)
    else:
        assert isinstance(opened, usmipc.SharedArray)
        assert opened.shape == expected.shape
        assert opened.dtype == expected.dtype.name
        got = np.from_dlpack(opened)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)


def _consumer(conn):
    dev = usmipc.Device(HOST)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        op, data, expected = msg
        try:
            tree = usmipc.open_shared(data, device=dev)
        except usmipc.Error as e:
            probe_exception(e, "consumer process: usmipc.open_shared")
            conn.send(("error", e.name, str(e)))
            continue
        if op == "check":
            _same(tree, expected)
            # Writes go to the producer's memory: no copy anywhere.
            np.from_dlpack(tree["embed"])[0, 0] = -7.0
            strided = np.from_dlpack(tree["layers"][0]["w"])
            strided[0, 0] = 999
        conn.send(("ok", usmipc.stats(), [type(x).__name__ for x in tree]))
        usmipc.close_shared(tree)


@pytest.fixture
def consumer():
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child,))
    proc.start()

    def call(op, data, expected=None):
        parent.send((op, data, expected))
        assert parent.poll(TIMEOUT), "the consumer did not answer"
        return parent.recv()

    yield call
    parent.send(None)
    proc.join(TIMEOUT)
    assert proc.exitcode == 0


def test_tree_round_trip_and_write_back(consumer):
    pool = MemoryPool(device=usmipc.Device(HOST))
    tree = _arrays(pool)
    expected = _expected(tree)
    bundle = usmipc.share(tree)
    assert bundle.arrays == 8 and bundle.allocations == 1
    data = bundle.to_bytes()
    status, stats, _ = consumer("check", data, expected)
    assert status == "ok"
    assert stats["driver_imports"] == 1  # one segment, eight arrays
    assert tree["embed"][0, 0] == -7.0
    assert tree["layers"][0]["w"][0, 0] == 999
    # The same arrays again after an in-place update: metadata only, on
    # both sides (the consumer's mapping is cached; nothing is exported).
    before = usmipc.stats()
    tree["embed"][:] += 1
    again = usmipc.share(tree)
    after = usmipc.stats()
    assert after["driver_exports"] == before["driver_exports"]
    expected = _expected(tree)
    status, stats2, _ = consumer("check", again.to_bytes(), expected)
    assert status == "ok"
    assert stats2["driver_imports"] == stats["driver_imports"]
    assert stats2["descriptors_received"] == stats["descriptors_received"]
    # Pickle carries the same bytes; the unpickled object opens too.
    status, _, kinds = consumer("open", pickle.dumps(again) and
                                pickle.loads(pickle.dumps(again)).to_bytes())
    assert status == "ok" and kinds == ["str"] * 5
    # Dropped by the producer: its bytes are refused, the memory lives on.
    del again
    gc.collect()
    status, name, message = consumer("open", bytes(data))
    assert status == "ok"  # the first bundle still lives
    data2 = usmipc.share(tree).to_bytes()  # dropped at once
    gc.collect()
    status, name, message = consumer("open", data2)
    assert (status, name) == ("error", "USMIPC_EEXPORTERGONE")
    assert "no longer shares this bundle" in message
    del bundle


def test_many_arrays_one_allocation(consumer):
    pool = MemoryPool(device=usmipc.Device(HOST))
    block = pool.allocate(10_000 * 4)
    flat = np.from_dlpack(block).view(np.float32)
    flat[:] = np.arange(10_000)
    tree = {f"layers.{i}.weight": flat[i * 4:(i + 1) * 4] for i in range(10_000)}
    bundle = usmipc.share(tree)
    assert bundle.arrays == 10_000 and bundle.allocations == 1
    status, stats, kinds = consumer("open", bundle.to_bytes())
    assert status == "ok" and len(kinds) == 10_000
    assert stats["driver_imports"] == 1


def test_same_process_open_and_close():
    pool = MemoryPool(device=usmipc.Device(HOST))
    tree = _arrays(pool)
    bundle = usmipc.share(tree)
    opened = usmipc.open_shared(bundle)
    _same(opened, _expected(tree))
    leaf = opened["embed"]
    view = np.from_dlpack(leaf)  # an export: the close waits for it
    leaf.close()
    assert leaf.closed
    assert view[1, 1] == 101.0  # still mapped while the view lives
    with pytest.raises(ValueError, match="closed"):
        leaf.__dlpack__()
    del view
    usmipc.close_shared(opened)
    with pytest.raises(TypeError, match="not a shared array"):
        usmipc.close_shared({"x": 1})
    assert memoryview(usmipc.open_shared(bundle)["ключ"]).format == "f"


def test_usmipc_memory_leaves():
    dev = usmipc.Device(HOST)
    mem = MemoryUSMDevice(1000, device=dev)
    mem.memset(3)
    bundle = usmipc.share([mem])
    opened = usmipc.open_shared(bundle.to_bytes())
    leaf = opened[0]
    assert leaf.dtype == "uint8" and leaf.shape == (1000,)
    assert bytes(memoryview(leaf)[:2]) == b"\x03\x03"


def test_bad_input_is_refused_with_where():
    dev = usmipc.Device(HOST)
    pool = MemoryPool(device=dev)
    good = np.from_dlpack(pool.allocate(64)).view(np.float32)
    with pytest.raises(TypeError, match=r"at \['a'\]\[1\]: an int is not an "
                                        "array"):
        usmipc.share({"a": [good, 1]})
    with pytest.raises(TypeError, match="keys must be str"):
        usmipc.share({1: good})
    with pytest.raises(usmipc.Error, match=r"at \['x'\]"):
        usmipc.share({"x": np.zeros(4)})  # ordinary memory, not usmipc's
    host_kind = usmipc.memory.MemoryUSMHost(64, device=dev)
    with pytest.raises(TypeError, match="at the root: .*only device memory"):
        usmipc.share(host_kind)
    with pytest.raises(ValueError, match="negative strides"):
        usmipc.share(good[::-1])
    data = usmipc.share({"x": good}).to_bytes()
    for bad in (data[:-1], data[:100], b"", b"\x89USMIPC\n" + bytes(300)):
        with pytest.raises(ValueError) as e:  # as for handle bytes
            usmipc.open_shared(bad)
        assert e.value.name == "USMIPC_EBADHANDLE"
    corrupt = bytearray(data)
    corrupt[80] ^= 1
    with pytest.raises(ValueError, match="checksum"):
        usmipc.open_shared(bytes(corrupt))
    with pytest.raises(TypeError):
        usmipc.open_shared(12)


def test_slot_past_the_export_table_is_refused(consumer):
    """The bundle's own slot (offset 24) past the producer's export table,
    checksum recomputed: a consumer in another process used to read outside
    its mapping of the table (SIGSEGV for 0xFFFFFFF0); now it is told the
    bytes are forged, and still opens honest bytes afterwards."""
    pool = MemoryPool(device=usmipc.Device(HOST))
    good = np.from_dlpack(pool.allocate(64)).view(np.float32)
    bundle = usmipc.share({"x": good})
    data = bundle.to_bytes()
    for slot in (0x00100005, 0xFFFFFFF0):
        forged = bytearray(data)
        forged[24:28] = slot.to_bytes(4, "little")
        forged = reseal(forged)
        with pytest.raises(ValueError, match="slot .* export table") as e:
            usmipc.open_shared(forged)
        assert e.value.name == "USMIPC_EBADHANDLE"
        status, name, message = consumer("open", forged)
        assert status == "error" and name == "USMIPC_EBADHANDLE", message
        assert f"slot {slot} is beyond" in message
    status, _, _ = consumer("open", data)
    assert status == "ok"


def _nested_lists(levels):
    """Bundle bytes of no memory: levels nested lists, the innermost empty
    (docs/handle-format.md, "Bundles")."""
    import struct
    nodes = b"".join(struct.pack("<BBHI", 2, 0, 0, 1 if i + 1 < levels else 0)
                     for i in range(levels))
    length = 64 + len(nodes) + 4
    header = (b"\x89USMIPCB" + struct.pack("<HHIQII", 1, 0, length, 0,
                                          0xFFFFFFFF, 0)
              + bytes(16) + struct.pack("<IIII", 0, 0, levels, 0))
    return reseal(header + nodes + bytes(4))


def test_one_depth_limit():
    """share() and the decoder count levels alike: at most 64, the root the
    first, a leaf or an empty container a level like any node. The decoder
    used to open 65 levels whose innermost container was empty."""
    pool = MemoryPool(device=usmipc.Device(HOST))
    leaf = np.from_dlpack(pool.allocate(64)).view(np.float32)
    tree, empty = leaf, []
    for _ in range(63):
        tree, empty = [tree], [empty]
    for deep in (tree, empty):  # 64 levels
        bundle = usmipc.share(deep)
        root = opened = usmipc.open_shared(bundle.to_bytes())
        for _ in range(63):
            opened = opened[0]
        assert opened == [] if deep is empty else opened.shape == (16,)
        usmipc.close_shared(root)
    for deep in ([tree], [empty]):  # 65
        with pytest.raises(ValueError, match="deeper than 64 levels"):
            usmipc.share(deep)
    opened = usmipc.open_shared(_nested_lists(64))
    for _ in range(63):
        opened = opened[0]
    assert opened == []
    with pytest.raises(ValueError, match="node 64: the tree is nested deeper "
                                         "than 64 levels") as e:
        usmipc.open_shared(_nested_lists(65))
    assert e.value.name == "USMIPC_EBADHANDLE"


def test_example_runs():
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable,
                             str(root / "examples" / "share_state_dict.py")],
                            capture_output=True, timeout=TIMEOUT * 2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert b"bundle OK" in result.stdout


def test_open_shared_to_torch_on_host():
    torch = pytest.importorskip("torch")
    pool = MemoryPool(device=usmipc.Device(HOST))
    a = np.from_dlpack(pool.allocate(4000)).view(np.float32)
    a[:] = np.arange(1000)
    bundle = usmipc.share({"a": a.reshape(10, 100), "t": a.reshape(10, 100).T,
                           "e": a[:0], "l": [a[5:8]]})
    tree = usmipc.open_shared(bundle.to_bytes(), to="torch")
    assert isinstance(tree["l"], list) and isinstance(tree["a"], torch.Tensor)
    assert tree["t"].shape == (100, 10) and tree["t"].stride() == (1, 100)
    assert tree["a"].sum().item() == 499500.0 and tree["e"].numel() == 0
    tree["l"][0][0] = -1  # the producer's memory
    assert a[5] == -1
    with pytest.raises(ValueError, match="'torch'"):
        usmipc.open_shared(bundle.to_bytes(), to="jax")


def test_open_shared_to_torch_after_fork():
    """to="torch" looks torch's converter up once per process (and a
    forked child again): a child forked after the parent's open still gets
    tensors of the parent's memory."""
    torch = pytest.importorskip("torch")
    pool = MemoryPool(device=usmipc.Device(HOST))
    a = np.from_dlpack(pool.allocate(64)).view(np.int32)
    a[:] = np.arange(16)
    bundle = usmipc.share([a])
    raw = bundle.to_bytes()
    assert usmipc.open_shared(raw, to="torch")[0].sum().item() == 120
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            t = usmipc.open_shared(raw, to="torch")[0]
            t[0] = -5  # the parent's memory
            code = 0 if isinstance(t, torch.Tensor) and t[1] == 1 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert a[0] == -5


def test_cpu_tensor_of_usmipc_memory_shares():
    """A CPU tensor viewing usmipc host memory (what gloo ranks hand to
    usmipc.distributed.exchange) shares like the memory; a CPU tensor of
    torch's own allocator does not, and the error says what to do."""
    torch = pytest.importorskip("torch")
    mem = MemoryUSMDevice(4096, device=usmipc.Device(HOST))
    t = torch.from_dlpack(mem).view(torch.int32)[4:20].view(4, 4)
    t.copy_(torch.arange(16, dtype=torch.int32).view(4, 4))
    bundle = usmipc.share({"t": t, "e": torch.empty(0)})
    tree = usmipc.open_shared(bundle.to_bytes(), to="torch")
    assert tree["t"].shape == (4, 4) and tree["t"].dtype == torch.int32
    assert tree["t"].tolist() == t.tolist()
    tree["t"][3, 3] = -7  # the same memory, not a copy
    assert t[3, 3].item() == -7
    with pytest.raises(TypeError, match="torch's own memory.*host:cpu"):
        usmipc.share({"ok": t, "bad": torch.zeros(16)})


def test_cpu_tensor_of_usmipc_memory_keeps_the_bundles_error():
    """share() asks a torch tensor whether it is a CPU tensor only when the
    bundle refused its memory, to say so in torch's terms; a CPU tensor of
    usmipc memory refused for another reason (here: host-kind memory, which
    never travels) gets the bundle's own error, which names the kind, with
    the path to it; not torch's "own memory" one, which would be wrong."""
    torch = pytest.importorskip("torch")
    from usmipc.memory import MemoryUSMHost
    dev = MemoryUSMDevice(4096, device=usmipc.Device(HOST))
    host = MemoryUSMHost(4096, device=usmipc.Device(HOST))
    ok = torch.from_dlpack(dev).view(torch.int32)
    pinned_kind = torch.from_dlpack(host).view(torch.int32)
    assert pinned_kind.is_cpu
    with pytest.raises(usmipc.MemoryKindError) as e:
        usmipc.share({"ok": ok, "host": pinned_kind})
    assert "own memory" not in str(e.value), str(e.value)
    assert "host memory" in str(e.value) and "['host']" in str(e.value)
    # A storage (what usmipc.torch sends) of that memory: the same.
    with pytest.raises(usmipc.MemoryKindError) as e:
        usmipc.share({"s": pinned_kind.untyped_storage()})
    assert "own memory" not in str(e.value), str(e.value)
    assert "host memory" in str(e.value) and "['s']" in str(e.value)
    with pytest.raises(TypeError, match="CPU storage of torch's own memory"):
        usmipc.share({"s": torch.zeros(4).untyped_storage()})


def test_leaves_of_alternating_kinds_and_dtypes():
    """share() remembers the last leaf type and torch dtype it read (a
    pointer compare instead of a dict lookup); leaves that alternate
    between torch tensors of four dtypes, a tensor subclass, usmipc memory
    and NumPy arrays each arrive as themselves."""
    torch = pytest.importorskip("torch")
    mem = MemoryUSMDevice(1 << 16, device=usmipc.Device(HOST))
    raw = torch.from_dlpack(mem)
    raw.copy_(torch.arange(1 << 16, dtype=torch.int64).to(torch.uint8))
    dtypes = [torch.int32, torch.float64, torch.bfloat16, torch.uint8]

    class Param(torch.Tensor):  # a framework's own tensor class
        pass

    tree, want = {}, {}
    for i in range(64):
        at = 512 * i
        if i % 7 == 6:
            tree[f"m{i}"] = m = MemoryUSMDevice(64,
                                                 device=usmipc.Device(HOST))
            np.from_dlpack(m)[:] = i
            want[f"m{i}"] = ("u1", [i] * 64)
        elif i % 7 == 5:
            a = np.from_dlpack(mem)[at:at + 8].view(np.int16)
            tree[f"n{i}"] = a
            want[f"n{i}"] = ("i2", a.tolist())
        else:
            dt = dtypes[i % len(dtypes)]
            t = raw[at:at + 64].view(dt)[:4]
            if i % 3 == 0:
                t = t.as_subclass(Param)
            tree[f"t{i}"] = t
            want[f"t{i}"] = (dt, torch.Tensor(t).tolist())
    bundle = usmipc.share(tree)
    got = usmipc.open_shared(bundle.to_bytes())
    for k, (dt, values) in want.items():
        if isinstance(dt, str):
            a = np.from_dlpack(got[k])
            assert a.dtype == np.dtype(dt) and a.tolist() == values, k
        else:
            t = torch.from_dlpack(got[k])
            assert t.dtype == dt and t.tolist() == values, k


class _Interface:
    """A leaf described by __cuda_array_interface__ over host memory."""

    def __init__(self, base, shape, strides, typestr="|u1"):
        self.base = base
        self.__cuda_array_interface__ = {
            "data": (base.ctypes.data, False), "shape": shape,
            "typestr": typestr, "strides": strides, "version": 3}


def test_broadcast_array_sizes_do_not_wrap():
    # A valid broadcast array (zero strides) of 2^120 one-byte elements:
    # size and nbytes were 0 (the product wrapped in 64 bits) and the
    # buffer's len too. Now exact Python ints, and no buffer.
    pool = MemoryPool(device=usmipc.Device(HOST))
    base = np.from_dlpack(pool.allocate(64))
    tree = {"b": _Interface(base, (2**40,) * 3, (0, 0, 0)),
            "f": _Interface(base, (2**31, 2**31), (0, 0), "<f8"),
            "s": _Interface(base, (4,), (1,))}
    bundle = usmipc.share(tree, ordered=False)
    opened = usmipc.open_shared(bundle.to_bytes())
    b, f = opened["b"], opened["f"]
    assert (b.size, b.nbytes, b.shape) == (2**120, 2**120, (2**40,) * 3)
    assert (f.size, f.nbytes) == (2**62, 2**65)
    assert f.strides == (0, 0)
    for arr in (b, f):
        with pytest.raises(BufferError, match="does not fit in a Py_ssize_t"):
            memoryview(arr)
    assert (opened["s"].size, opened["s"].nbytes) == (4, 4)
    assert memoryview(opened["s"]).nbytes == 4
    usmipc.close_shared(opened)


def test_contiguous_strides_that_overflow_are_refused():
    # No strides given: C-contiguous ones are computed, and a shape whose
    # element count passes 64 bits has none (before: a signed overflow).
    pool = MemoryPool(device=usmipc.Device(HOST))
    base = np.from_dlpack(pool.allocate(64))
    with pytest.raises(usmipc.ArgumentError,
                       match=r"at \['x'\]: .*more elements than 64 bits"):
        usmipc.share({"x": _Interface(base, (2**40,) * 3, None)},
                     ordered=False)


def test_lone_surrogate_key_names_its_path():
    # Before: a bare UnicodeEncodeError, without saying which key.
    pool = MemoryPool(device=usmipc.Device(HOST))
    leaf = np.from_dlpack(pool.allocate(8))
    with pytest.raises(usmipc.ArgumentError,
                       match=r"share\(\): at \['layers'\]\[0\]\['\\ud800x'\]: "
                             r"the dict key has no UTF-8 form") as info:
        usmipc.share({"layers": [{"ok": leaf, "\ud800x": leaf}]},
                     ordered=False)
    assert not isinstance(info.value, UnicodeError)


def _keys_of_opens(conn, raws):
    """Opens each bundle in turn (closing it before the next) and sends
    back every dict's keys, nested, with the first array's first value."""
    dev = usmipc.Device(HOST)

    def keys(node):
        if isinstance(node, dict):
            return [(k, keys(v)) for k, v in node.items()]
        if isinstance(node, (list, tuple)):
            return [keys(v) for v in node]
        return float(np.from_dlpack(node).reshape(-1)[0])

    out = []
    for raw in raws:
        tree = usmipc.open_shared(raw, device=dev)
        out.append(keys(tree))
        usmipc.close_shared(tree)
    conn.send(out)


def test_keys_of_trees_opened_in_turn():
    """open_shared() keeps the keys of the last opens to hand out again
    (an engine opens the same tree every step): trees that differ from
    each other in some keys at the same places, non-ASCII keys, a key
    that is a prefix of the one before, opened in turn, each get their
    own keys, values and order."""
    from conftest import join_ok, recv_from, spawn_peer
    pool = MemoryPool(device=usmipc.Device(HOST))
    x = np.from_dlpack(pool.allocate(64)).view(np.float32)
    x[:] = 1
    y = np.from_dlpack(pool.allocate(64)).view(np.float32)
    y[:] = 2
    trees = [
        {"model.layers.0.weight": x, "model.layers.0.bias": y},
        {"model.layers.0.weight": y, "model.layers.1.bias": x},
        {"gewicht.\u00e9\u20ac\U0001f600": x, "model.layers.0": {"bias": y}},
        {"model.layers.0.weight": x, "model.layers.0.bias": y},
        {"model.layers.0.weigh": x, "": [y, {"b": x}]},
    ]
    bundles = [usmipc.share(t) for t in trees]
    conn, proc = spawn_peer(_keys_of_opens, [b.to_bytes() for b in bundles])
    got = recv_from(conn, proc)
    join_ok(proc)

    def keys(node):
        if isinstance(node, dict):
            return [(k, keys(v)) for k, v in node.items()]
        if isinstance(node, (list, tuple)):
            return [keys(v) for v in node]
        return float(node.reshape(-1)[0])

    assert got == [keys(t) for t in trees]
