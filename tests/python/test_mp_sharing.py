"""multiprocessing moves usmipc device memory as the memory itself (an IPC
mapping, no copy) with every start method and through
concurrent.futures.ProcessPoolExecutor, also when the sender drops its last
reference right after put(); plain pickle makes a copy, as dpctl does."""
import concurrent.futures
import gc
import multiprocessing
import pickle

import pytest

import usmipc
from usmipc.memory import MemoryIPCDevice, MemoryUSMDevice, MemoryUSMHost

from conftest import TIMEOUT

HOST = "host:cpu"


def pattern(n, seed):
    return bytes((i * 7 + seed) % 251 for i in range(n))


def _child(q, results):
    for _ in range(2):
        m = q.get(timeout=TIMEOUT)
        ok = isinstance(m, MemoryIPCDevice) and isinstance(m, MemoryUSMDevice)
        data = bytes(m.copy_to_host())
        m.copy_from_host(b"from child")  # lands in the sender's memory
        results.put((ok, data == pattern(4096, 5), len(data)))
        del m  # closes the mapping: the sender's ticket comes back
        gc.collect()


def temporary():
    mem = MemoryUSMDevice(4096, device=usmipc.Device(HOST))
    mem.copy_from_host(pattern(4096, 5))
    return mem


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_queue_moves_the_memory_itself(method):
    ctx = multiprocessing.get_context(method)
    q, results = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_child, args=(q, results))
    p.start()
    kept = temporary()
    q.put(temporary())  # the only reference goes with the put
    gc.collect()
    assert results.get(timeout=TIMEOUT) == (True, True, 4096)
    q.put(kept)
    assert results.get(timeout=TIMEOUT) == (True, True, 4096)
    p.join(TIMEOUT)
    assert p.exitcode == 0
    assert bytes(kept.copy_to_host())[:10] == b"from child"  # no copy anywhere


def _pool_task(mem):
    data = bytes(mem.copy_to_host())
    mem.copy_from_host(b"pool")
    return type(mem).__name__, data == pattern(4096, 5)


def test_process_pool_executor():
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
        mem = temporary()
        assert ex.submit(_pool_task, mem).result(TIMEOUT) == \
            ("MemoryIPCDevice", True)
        assert bytes(mem.copy_to_host())[:4] == b"pool"
        # a temporary: the pool's feeder pickles it after submit() returned
        assert ex.submit(_pool_task, temporary()).result(TIMEOUT)[1]


def test_plain_pickle_is_a_copy():
    mem = temporary()
    again = pickle.loads(pickle.dumps(mem))
    assert type(again) is MemoryUSMDevice and again._pointer != mem._pointer
    assert bytes(again.copy_to_host()) == bytes(mem.copy_to_host())
    host = MemoryUSMHost(8, device=usmipc.Device(HOST))
    host.memset(9)
    copy = pickle.loads(pickle.dumps(host))
    assert type(copy) is MemoryUSMHost
    assert bytes(copy.copy_to_host()) == b"\t" * 8
    m = usmipc.memory.IPCMemoryHandle.open(
        usmipc.memory.IPCMemoryHandle(mem).to_bytes())
    assert type(pickle.loads(pickle.dumps(m))) is MemoryUSMDevice
    m.close()
    with pytest.raises(ValueError, match="closed"):
        pickle.dumps(m)
