"""Allocation, copies, fills and the buffer protocol of usmipc.memory."""

import array
import gc

import pytest

import usmipc
from usmipc.memory import (MemoryIPCDevice, MemoryUSMDevice, MemoryUSMHost,
                           MemoryUSMShared, _Memory)

from conftest import is_known, pattern

KINDS = [(MemoryUSMDevice, "device"), (MemoryUSMHost, "host"),
         (MemoryUSMShared, "shared")]


@pytest.mark.parametrize("cls,kind", KINDS)
def test_alloc_copy_memset_round_trip(cls, kind, host):
    mem = cls(4096, device=host)
    assert isinstance(mem, _Memory)
    assert mem.nbytes == mem.size == len(mem) == 4096
    assert mem.kind == kind and mem.get_usm_type() == kind
    assert mem.device is host and mem.sycl_device is host
    assert mem.queue.device is host and mem.sycl_queue is mem.queue
    assert isinstance(mem._pointer, int) and mem._pointer != 0
    assert mem.is_closed is False

    data = pattern(4096, 3)
    assert mem.copy_from_host(data) is None
    assert bytes(mem.copy_to_host()) == data
    assert mem.tobytes() == data

    mem.copy_from_host(b"\xff" * 10)  # a shorter source fills the start
    assert bytes(mem.copy_to_host()) == b"\xff" * 10 + data[10:]

    mem.memset(0x5A)
    assert bytes(mem.copy_to_host()) == b"\x5a" * 4096
    mem.memset()
    assert bytes(mem.copy_to_host()) == bytes(4096)
    mem.memset(value=255)
    assert bytes(mem.copy_to_host()) == b"\xff" * 4096


@pytest.mark.parametrize("source", [
    bytearray(b"abc"), memoryview(b"abc"), array.array("B", b"abc"),
    memoryview(b"xxabcxx")[2:5],
])
def test_copy_from_any_buffer(source, host):
    mem = MemoryUSMDevice(8, device=host)
    mem.copy_from_host(source)
    assert bytes(mem.copy_to_host())[:3] == b"abc"


def test_copy_to_host_into_a_buffer(host):
    mem = MemoryUSMDevice(16, device=host)
    mem.copy_from_host(pattern(16, 9))
    out = bytearray(20)
    assert mem.copy_to_host(out) is out
    assert bytes(out[:16]) == pattern(16, 9) and bytes(out[16:]) == bytes(4)
    with pytest.raises(ValueError, match="too small"):
        mem.copy_to_host(bytearray(15))
    with pytest.raises((TypeError, BufferError)):
        mem.copy_to_host(bytes(16))  # read-only


def test_argument_errors(host):
    mem = MemoryUSMDevice(8, device=host)
    with pytest.raises(ValueError, match="does not fit"):
        mem.copy_from_host(b"123456789")
    with pytest.raises(TypeError):
        mem.copy_from_host("text is not bytes")
    with pytest.raises(ValueError):
        mem.memset(256)
    with pytest.raises(ValueError):
        mem.memset(-1)
    for n in (0, -1):
        with pytest.raises(ValueError, match="positive"):
            MemoryUSMDevice(n)
    with pytest.raises(TypeError):
        MemoryUSMDevice(8, queue="not a queue")
    with pytest.raises(TypeError):
        MemoryUSMDevice(8, device=host, sycl_device=host)
    with pytest.raises(TypeError):
        MemoryUSMDevice(8, host)  # device and queue are keyword-only
    with pytest.raises(ValueError):
        MemoryUSMDevice(8, device="no-such-backend")


def test_constructor_keywords(host):
    q = usmipc.Queue(host)
    assert MemoryUSMDevice(8, queue=q).queue is q
    assert MemoryUSMDevice(8, sycl_queue=q).queue is q
    assert MemoryUSMDevice(8, device=host, queue=q).queue is q
    assert MemoryUSMDevice(8, sycl_device=host).device is host
    assert MemoryUSMDevice(8, device="host:cpu").device is host
    assert MemoryUSMDevice(nbytes=8).device == usmipc.Device()
    # without a queue the device's default queue is used, and shared
    assert MemoryUSMDevice(8, device=host).queue is \
        MemoryUSMHost(8, device=host).queue


def test_cannot_instantiate_base_or_mapping_type():
    with pytest.raises(TypeError):
        _Memory(8)
    with pytest.raises(TypeError):
        MemoryIPCDevice(8)


def test_memory_keeps_queue_and_device_alive(host):
    q = usmipc.Queue(host)
    mem = MemoryUSMDevice(64, queue=q)
    del q
    gc.collect()
    mem.memset(1)
    mem.queue.synchronize()
    assert bytes(mem.copy_to_host()) == b"\x01" * 64


def test_free_on_garbage_collection(host):
    mem = MemoryUSMDevice(4096, device=host)
    address = mem._pointer
    assert is_known(address)
    del mem
    gc.collect()
    assert not is_known(address)


def test_memoryview_shares_memory(host):
    for cls, _ in KINDS:
        mem = cls(32, device=host)
        mem.memset(0)
        with memoryview(mem) as view:
            assert view.format == "B" and view.itemsize == 1
            assert view.nbytes == 32 and not view.readonly
            view[3] = 0x77
            assert bytes(mem.copy_to_host())[3] == 0x77
            mem.copy_from_host(b"\x11")
            assert view[0] == 0x11


def test_memoryview_keeps_memory_alive(host):
    view = memoryview(MemoryUSMDevice(16, device=host))
    gc.collect()
    view[:] = b"\x42" * 16
    assert bytes(view) == b"\x42" * 16
    assert bytes(view.obj.copy_to_host()) == b"\x42" * 16


def test_numpy_zero_copy(host):
    np = pytest.importorskip("numpy")
    mem = MemoryUSMDevice(256, device=host)
    mem.memset(0)
    a = np.asarray(mem)
    assert a.dtype == np.uint8 and a.shape == (256,)
    assert a.flags.writeable
    assert a.ctypes.data == mem._pointer
    a[:] = np.arange(256, dtype=np.uint8)  # write through numpy ...
    assert bytes(mem.copy_to_host()) == bytes(range(256))  # read by a copy
    mem.copy_from_host(b"\x09" * 256)
    assert int(a.sum()) == 9 * 256
    f = np.frombuffer(mem, dtype=np.float32)
    f[0] = 1.5
    assert np.frombuffer(mem.copy_to_host()[:4], dtype=np.float32)[0] == 1.5


def test_subclass(host):
    class Tagged(MemoryUSMDevice):
        pass

    mem = Tagged(10, device=host)
    mem.copy_from_host(b"0123456789")
    assert mem.kind == "device" and bytes(memoryview(mem)) == b"0123456789"
    assert "Tagged" in repr(mem)
