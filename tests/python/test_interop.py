"""DLPack and the CUDA array interface on the host backend: zero-copy
export, the capsule's hold on a mapping, and exporting another library's
array (a stand-in with __cuda_array_interface__)."""

import gc

import pytest

import usmipc
from usmipc.memory import IPCMemoryHandle, MemoryUSMDevice, MemoryUSMHost

from conftest import is_known, pattern


class ForeignArray:
    """Stands in for a torch tensor or CuPy array: only the interface."""

    def __init__(self, address, shape, typestr="|u1", strides=None):
        self.__cuda_array_interface__ = {
            "data": (address, False), "shape": shape, "typestr": typestr,
            "strides": strides, "version": 3}


def test_dlpack_device_and_capsules(host):
    mem = MemoryUSMDevice(64, device=host)
    assert mem.__dlpack_device__() == (1, 0)  # kDLCPU
    assert "dltensor" in repr(mem.__dlpack__())
    assert "dltensor_versioned" in repr(mem.__dlpack__(max_version=(1, 0)))
    assert "dltensor_versioned" not in repr(mem.__dlpack__(max_version=(0, 8)))
    with pytest.raises(BufferError):
        mem.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError):
        mem.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        mem.__dlpack__(stream=1)  # streams are for device memory
    mem.__dlpack__(dl_device=(1, 0), copy=False)


def test_numpy_from_dlpack_is_zero_copy(host):
    np = pytest.importorskip("numpy")
    mem = MemoryUSMDevice(128, device=host)
    mem.copy_from_host(pattern(128, 4))
    a = np.from_dlpack(mem)
    assert a.dtype == np.uint8 and a.shape == (128,)
    assert a.ctypes.data == mem._pointer
    assert a.tobytes() == pattern(128, 4)
    a[:2] = 0xAB
    assert mem.copy_to_host()[:2] == b"\xab\xab"
    del mem
    gc.collect()
    a[2] = 1  # the capsule's owner keeps the allocation alive
    assert a[2] == 1


def test_capsule_defers_the_unmap_of_a_closed_mapping(exporter, no_ipc_cache):
    m = IPCMemoryHandle.open(exporter.raw)
    address = m._pointer
    capsule = m.__dlpack__()
    m.close()
    assert m.is_closed and is_known(address)
    with pytest.raises(ValueError, match="mapping is closed"):
        m.__dlpack__()
    del capsule  # never consumed: its destructor releases the export
    gc.collect()
    assert not is_known(address)


def test_numpy_array_from_dlpack_holds_a_closed_mapping(exporter,
                                                        no_ipc_cache):
    np = pytest.importorskip("numpy")
    m = IPCMemoryHandle.open(exporter.raw)
    address = m._pointer
    a = np.from_dlpack(m)
    IPCMemoryHandle.close_mapping(m)
    del m
    gc.collect()
    assert is_known(address)
    assert a[:8].tobytes() == pattern(8, 1)
    a[0] = 0x3C
    assert exporter.dump()[0] == 0x3C
    del a
    gc.collect()
    assert not is_known(address)


def test_cuda_array_interface_is_for_cuda_memory_only(host):
    mem = MemoryUSMDevice(16, device=host)
    assert not hasattr(mem, "__cuda_array_interface__")
    with pytest.raises(AttributeError, match="CUDA"):
        mem.__cuda_array_interface__


def test_export_through_cuda_array_interface(host):
    mem = MemoryUSMDevice(4096, device=host)
    mem.copy_from_host(pattern(4096, 5))
    # an int32 array of 16 x 8 elements at byte 256 of the allocation
    foreign = ForeignArray(mem._pointer + 256, (16, 8), "<i4")
    h = IPCMemoryHandle(foreign)
    assert h.memory is foreign and h.device is host
    assert (h.offset, h.nbytes) == (256, 16 * 8 * 4)
    with IPCMemoryHandle.open(h.to_bytes()) as m:
        assert m.copy_to_host() == pattern(4096, 5)[256:256 + 512]
    h = IPCMemoryHandle(foreign, offset=4, nbytes=8)
    assert (h.offset, h.nbytes) == (260, 8)
    # C-contiguous strides are fine, others are not one byte range
    IPCMemoryHandle(ForeignArray(mem._pointer, (4, 2), "<i4", (8, 4)))
    with pytest.raises(ValueError, match="contiguous"):
        IPCMemoryHandle(ForeignArray(mem._pointer, (4, 2), "<i4", (4, 16)))
    with pytest.raises(ValueError, match="empty"):
        IPCMemoryHandle(ForeignArray(mem._pointer, (0,)))


def test_foreign_export_of_unknown_or_host_memory(host):
    np = pytest.importorskip("numpy")
    a = np.zeros(64, np.uint8)  # malloc'd by numpy: no driver knows it
    with pytest.raises(usmipc.Error) as info:
        IPCMemoryHandle(ForeignArray(a.ctypes.data, (64,)))
    assert info.value.name == "USMIPC_EUNKNOWNPTR"
    pinned = MemoryUSMHost(64, device=host)
    with pytest.raises(TypeError):  # USMIPC_EMEMKIND
        IPCMemoryHandle(ForeignArray(pinned._pointer, (64,)))


def test_allocation_ipc_flavour(host):
    for ipc in ("fd", "native", None):
        mem = MemoryUSMDevice(64, device=host, ipc=ipc)
        with IPCMemoryHandle.open(IPCMemoryHandle(mem)) as m:
            assert m.nbytes == 64
    with pytest.raises(ValueError, match="ipc"):
        MemoryUSMDevice(64, device=host, ipc="carrier-pigeon")


def test_cache_size_class_method(exporter):
    IPCMemoryHandle.set_cache_size(0)
    try:
        m = IPCMemoryHandle.open(exporter.raw)
        address = m._pointer
        m.close()
        assert not is_known(address)
    finally:
        IPCMemoryHandle.set_cache_size(64)
    with pytest.raises(ValueError):
        IPCMemoryHandle.set_cache_size(-1)
