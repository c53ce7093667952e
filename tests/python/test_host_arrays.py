"""NumPy users' path (issue 25): ordinary NumPy memory is refused by share()
and IPCMemoryHandle() with a MemoryKindError saying what to do, and
usmipc.memory.host_array(array) puts an array into shareable memory that
another process reads and writes."""
import numpy as np
import pytest

import usmipc
from usmipc.memory import IPCMemoryHandle, host_array

from conftest import join_ok, recv_from, spawn_peer


def test_plain_numpy_says_what_to_do():
    with pytest.raises(usmipc.MemoryKindError,
                       match=r"at \['w'\].*usmipc\.memory\.host_array"):
        usmipc.share({"w": np.ones(4)})
    with pytest.raises(usmipc.MemoryKindError, match="host_array"):
        IPCMemoryHandle(np.ones(4))


def _consumer(conn, raw):
    tree = usmipc.open_shared(raw, device=usmipc.Device("host:cpu"))
    w = np.from_dlpack(tree["w"])
    conn.send((w.dtype.str, w.shape, float(w.sum())))
    w[0, 0] = -1.0  # the producer sees it: no copy anywhere
    conn.send("written")
    conn.recv()


def test_host_array_shares_both_ways():
    src = np.arange(12.0).reshape(3, 4)
    w = host_array(src)
    assert w.dtype == src.dtype and w.shape == (3, 4)
    np.testing.assert_array_equal(w, src)
    bundle = usmipc.share({"w": w})
    conn, proc = spawn_peer(_consumer, bundle.to_bytes())
    assert recv_from(conn, proc) == (src.dtype.str, (3, 4), float(src.sum()))
    assert recv_from(conn, proc) == "written"
    assert w[0, 0] == -1.0
    conn.send("done")
    join_ok(proc)


def test_host_array_edges():
    assert host_array([]).shape == (0,)
    assert host_array(np.float32(2.5)).shape == ()
    assert host_array([[True, False]]).dtype == np.bool_
    with pytest.raises(usmipc.ArgumentTypeError, match="Python objects"):
        host_array(np.array([object()]))
