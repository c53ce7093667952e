"""DLPack and the CUDA array interface on the host backend: zero-copy
export, the capsule's hold on a mapping, and exporting another library's
array (stand-ins with __cuda_array_interface__ or only __dlpack__)."""

import gc
import sys

import pytest

import usmipc
from usmipc.memory import IPCMemoryHandle, MemoryUSMDevice, MemoryUSMHost

from conftest import PATTERN_SRC, is_known, pattern, run_python


class ForeignArray:
    """Stands in for a torch tensor or CuPy array: only the interface."""

    def __init__(self, address, shape, typestr="|u1", strides=None):
        self.__cuda_array_interface__ = {
            "data": (address, False), "shape": shape, "typestr": typestr,
            "strides": strides, "version": 3}


class DLPackOnly:
    """Stands in for a JAX array or any DLPack producer: only __dlpack__,
    delegated to the wrapped object."""

    def __init__(self, obj):
        self.obj = obj

    def __dlpack__(self, **kwargs):
        return self.obj.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.obj.__dlpack_device__()


class LegacyDLPack(DLPackOnly):
    """A producer from before DLPack 1.0: __dlpack__ takes no max_version
    (a TypeError) and returns an unversioned "dltensor" capsule."""

    def __dlpack__(self, stream=None):
        return self.obj.__dlpack__(stream)


def test_dlpack_device_and_capsules(host):
    mem = MemoryUSMDevice(64, device=host)
    assert mem.__dlpack_device__() == (1, 0)  # kDLCPU
    assert "dltensor" in repr(mem.__dlpack__())
    assert "dltensor_versioned" in repr(mem.__dlpack__(max_version=(1, 0)))
    assert "dltensor_versioned" not in repr(mem.__dlpack__(max_version=(0, 8)))
    with pytest.raises(BufferError):
        mem.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError):
        mem.__dlpack__(dl_device=(1, 0), copy=False, stream=5)
    assert "dltensor" in repr(mem.__dlpack__(copy=True))  # a copy (parity)
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
    assert bytes(mem.copy_to_host())[:2] == b"\xab\xab"
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
        assert bytes(m.copy_to_host()) == pattern(4096, 5)[256:256 + 512]
    h = IPCMemoryHandle(foreign, offset=4, nbytes=8)
    assert (h.offset, h.nbytes) == (260, 8)
    # C-contiguous strides are fine, others are not one byte range
    IPCMemoryHandle(ForeignArray(mem._pointer, (4, 2), "<i4", (8, 4)))
    with pytest.raises(ValueError, match="contiguous"):
        IPCMemoryHandle(ForeignArray(mem._pointer, (4, 2), "<i4", (4, 16)))
    with pytest.raises(ValueError, match="empty"):
        IPCMemoryHandle(ForeignArray(mem._pointer, (0,)))


def test_cuda_array_interface_is_preferred_to_dlpack(host):
    class Both(ForeignArray):
        def __dlpack__(self, **kwargs):
            raise AssertionError("__dlpack__ called")

    mem = MemoryUSMDevice(64, device=host)
    h = IPCMemoryHandle(Both(mem._pointer, (64,)))
    assert h.nbytes == 64


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


# The importer of the DLPack tests: handle bytes (hex) on stdin; checks
# that they map bytes offset.. of pattern 6 (offset in argv), writes
# pattern 7, says "OK <nbytes>".
DLPACK_IMPORTER_SRC = PATTERN_SRC + """
import sys
from usmipc.memory import IPCMemoryHandle

offset = int(sys.argv[1])
with IPCMemoryHandle.open(bytes.fromhex(sys.stdin.read())) as m:
    assert bytes(m.copy_to_host()) == \
        pattern(4096, 6)[offset:offset + m.nbytes]
    m.copy_from_host(pattern(m.nbytes, 7))
    print("OK", m.nbytes)
"""


def test_export_through_dlpack_read_back_in_another_process(host):
    mem = MemoryUSMDevice(4096, device=host)
    mem.copy_from_host(pattern(4096, 6))
    producer = DLPackOnly(mem)
    h = IPCMemoryHandle(producer, offset=256, nbytes=1024)
    assert h.memory is producer and h.device is host
    assert (h.offset, h.nbytes, h.allocation_size) == (256, 1024, 4096)
    result = run_python(DLPACK_IMPORTER_SRC, input=h.to_bytes().hex().encode(),
                        args=("256",))
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().split() == ["OK", "1024"]
    assert bytes(mem.copy_to_host())[256:256 + 1024] == pattern(1024, 7)


@pytest.mark.parametrize("producer", [DLPackOnly, LegacyDLPack])
def test_dlpack_deleter_runs_once_when_the_handle_dies(host, producer):
    mem = MemoryUSMDevice(4096, device=host)
    wrapper = producer(mem)
    before = sys.getrefcount(mem)
    h = IPCMemoryHandle(wrapper)
    assert h.nbytes == 4096
    # the consumed tensor holds the memory (our __dlpack__'s manager_ctx)
    assert sys.getrefcount(mem) == before + 1
    h2 = IPCMemoryHandle(wrapper, offset=8, nbytes=16)  # a second tensor
    assert sys.getrefcount(mem) == before + 2
    del h, h2
    gc.collect()
    # one deleter call per tensor: a second would drop a reference too many
    assert sys.getrefcount(mem) == before


def test_dlpack_tensor_keeps_the_producers_memory_alive(host):
    class OneShot:
        """Hands its memory over in the capsule and forgets it."""

        def __init__(self, mem):
            self.mem = mem

        def __dlpack__(self, **kwargs):
            mem, self.mem = self.mem, None
            return mem.__dlpack__(**kwargs)

    mem = MemoryUSMDevice(4096, device=host)
    mem.copy_from_host(pattern(4096, 6))
    address = mem._pointer
    h = IPCMemoryHandle(OneShot(mem))
    del mem
    gc.collect()
    assert is_known(address)  # only the handle's tensor holds the memory
    result = run_python(DLPACK_IMPORTER_SRC, input=h.to_bytes().hex().encode(),
                        args=("0",))
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().split() == ["OK", "4096"]
    del h
    gc.collect()
    assert not is_known(address)  # its deleter let the memory go


def test_numpy_view_of_device_memory_is_exported_through_dlpack(host):
    np = pytest.importorskip("numpy")
    mem = MemoryUSMDevice(4096, device=host)
    mem.copy_from_host(pattern(4096, 6))
    a = np.from_dlpack(mem).view(np.int32).reshape(32, 32)
    h = IPCMemoryHandle(a[2:10])  # numpy has __dlpack__, no CUDA interface
    assert h.memory is not None and (h.offset, h.nbytes) == (256, 1024)
    with IPCMemoryHandle.open(h) as m:
        assert bytes(m.copy_to_host()) == pattern(4096, 6)[256:256 + 1024]
    before = sys.getrefcount(a)
    h = IPCMemoryHandle(a)
    # h.memory is a, and numpy's tensor holds it too
    assert sys.getrefcount(a) == before + 2
    del h
    gc.collect()
    assert sys.getrefcount(a) == before


def test_dlpack_strided_tensor_is_refused(host):
    np = pytest.importorskip("numpy")
    mem = MemoryUSMDevice(4096, device=host)
    a = np.from_dlpack(mem).reshape(64, 64)
    before = sys.getrefcount(a)
    for strided in (a[::2], a[:, :8], a.T):
        with pytest.raises(ValueError,
                           match="IPCMemoryHandle needs contiguous memory"):
            IPCMemoryHandle(strided)
    with pytest.raises(ValueError, match="contiguous"):
        IPCMemoryHandle(DLPackOnly(a[:, 1]))
    IPCMemoryHandle(a[3:5])  # rows are one byte range
    IPCMemoryHandle(a[:1, :8])  # and so is part of a single row
    gc.collect()
    assert sys.getrefcount(a) == before  # refused tensors were deleted


def test_dlpack_cpu_memory_is_not_device_memory(host):
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match="ordinary CPU memory"):
        IPCMemoryHandle(np.arange(64, dtype=np.uint8))
    with pytest.raises(TypeError, match="ordinary CPU memory"):
        IPCMemoryHandle(DLPackOnly(np.arange(64, dtype=np.uint8)))
    with pytest.raises(TypeError, match="kind 'host'"):
        IPCMemoryHandle(DLPackOnly(MemoryUSMHost(64, device=host)))


def test_dlpack_capsules_that_cannot_be_consumed(host):
    mem = MemoryUSMDevice(64, device=host)
    capsule = mem.__dlpack__(max_version=(1, 0))

    class SameCapsule:
        def __dlpack__(self, **kwargs):
            return capsule

    IPCMemoryHandle(SameCapsule())
    assert "used_dltensor_versioned" in repr(capsule)
    with pytest.raises(BufferError, match="already consumed"):
        IPCMemoryHandle(SameCapsule())

    class NotACapsule:
        def __dlpack__(self, **kwargs):
            return b"dltensor"

    with pytest.raises(TypeError, match="not a DLPack capsule"):
        IPCMemoryHandle(NotACapsule())

    class Failing:
        def __dlpack__(self, **kwargs):
            raise BufferError("cannot export")

    with pytest.raises(BufferError, match="cannot export"):
        IPCMemoryHandle(Failing())
    with pytest.raises(TypeError, match="__dlpack__"):
        IPCMemoryHandle(object())
