"""usmipc.memory.MemoryPool: blocks shared at the cost of one export per
segment, opened in a process started with spawn; freed blocks refused."""

import gc
import multiprocessing
import os

import pytest

import usmipc
from usmipc.memory import IPCMemoryHandle, MemoryPool, MemoryUSMDevice

from conftest import TIMEOUT, probe_exception

HOST = "host:cpu"


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _opener(conn, raws):
    dev = usmipc.Device(HOST)
    fds0 = _fds()
    maps = [IPCMemoryHandle.open(r, dev) for r in raws]
    values = [bytes(memoryview(m)[:1])[0] for m in maps]
    conn.send((values, _fds() - fds0))
    for m in maps:
        IPCMemoryHandle.close_mapping(m)
    late = conn.recv()
    try:
        IPCMemoryHandle.open(late, dev)
        conn.send("opened")
    except usmipc.Error as e:
        probe_exception(e, "peer process: IPCMemoryHandle.open (late)")
        conn.send(e.name)


def test_pool_blocks_in_a_spawned_process():
    dev = usmipc.Device(HOST)
    pool = MemoryPool(1 << 20, device=dev)
    blocks = [pool.allocate(4096 + i) for i in range(300)]
    for i, b in enumerate(blocks):
        assert isinstance(b, MemoryUSMDevice) and b.nbytes == 4096 + i
        b.memset(i % 251)
    raws = [IPCMemoryHandle(b, ordered=False).to_bytes() for b in blocks]
    assert all(IPCMemoryHandle.inspect(r)["nbytes"] == 4096 + i
               for i, r in enumerate(raws))
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_opener, args=(child, raws))
    proc.start()
    assert parent.poll(TIMEOUT)
    values, grown = parent.recv()
    assert values == [i % 251 for i in range(300)]
    assert grown <= 4, f"{grown} descriptors for 300 blocks of one segment"
    freed = raws[17]
    del blocks[17]
    gc.collect()
    parent.send(freed)
    assert parent.poll(TIMEOUT)
    assert parent.recv() == "USMIPC_EEXPORTERGONE"
    proc.join(TIMEOUT)
    assert proc.exitcode == 0


def test_pool_arguments():
    dev = usmipc.Device(HOST)
    with pytest.raises(ValueError):
        MemoryPool(-1, device=dev)
    with pytest.raises(ValueError):
        MemoryPool(device=dev, ipc="other")
    pool = MemoryPool(device=dev)
    assert pool.device == dev and "MemoryPool" in repr(pool)
    with pytest.raises(ValueError):
        pool.allocate(0)
    with pytest.raises(ValueError, match="power of two"):
        pool.allocate(64, alignment=3)
    b = pool.allocate(100, alignment=4096)
    assert b._pointer % 4096 == 0 if hasattr(b, "_pointer") else True
    # A block keeps its pool alive.
    del pool
    gc.collect()
    b.memset(1)
    assert bytes(b.copy_to_host())[:4] == b"\x01" * 4
