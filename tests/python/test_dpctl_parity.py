"""dpctl parity where a ported program would notice (issue 12): device
attributes a user prints, the extension's own argument errors as
usmipc.Error subclasses, __sycl_usm_array_interface__ and construction
from it, copy_to_host() and copy_from_device(), DLPack to NumPy.

The tests run on the default device: host:cpu here, and level_zero:gpu
through the test driver when run again with USMIPC_DEFAULT_DEVICE (the
last test does that, and requires that no test skips there)."""
import gc
import os
import re
import subprocess
import sys

import pytest

import usmipc
from usmipc.memory import (IPCMemoryHandle, MemoryIPCDevice, MemoryUSMDevice,
                           MemoryUSMHost, MemoryUSMShared)

from conftest import (PATTERN_SRC, is_known, pattern, rerun_on_level_zero,
                      skip_unless_level_zero_rerun)

ZE_TEST_DEVICE = "usmipc Level Zero test device"
KINDS = {"device": MemoryUSMDevice, "host": MemoryUSMHost,
         "shared": MemoryUSMShared}


@pytest.fixture
def queue():
    try:
        dev = usmipc.SyclDevice()
    except usmipc.SyclDeviceCreationError as e:
        pytest.skip(f"no default device: {e}")
    return usmipc.SyclQueue(dev)


# ---- device attributes ------------------------------------------------------


def test_device_attributes_a_user_prints(queue, capsys):
    dev = queue.sycl_device
    version = dev.driver_version
    total, largest = dev.global_mem_size, dev.max_mem_alloc_size
    assert isinstance(version, str) and version
    assert isinstance(total, int) and isinstance(largest, int)
    assert 0 < largest <= total
    if dev.backend == "host":
        assert version == os.uname().release
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        assert total == ram and largest == ram
    elif dev.name == ZE_TEST_DEVICE:
        # the test driver: driverVersion as SYCL prints it (1 in the ideal
        # profile), two memories of 3 GiB summed, maxMemAllocSize 1 GiB
        assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
        if os.environ.get("USMIPC_ZE_TEST_PROFILE", "ideal") == "ideal":
            assert version == "0.0.1"
        assert total == 2 * (3 << 30) and largest == 1 << 30
    dev.print_device_info()
    out = capsys.readouterr().out
    assert f"Driver version  {version}\n" in out
    assert f"Global memory   {total} bytes" in out
    assert f"Max allocation  {largest} bytes" in out


# ---- the extension's own errors ---------------------------------------------


def test_argument_errors_are_usmipc_errors(queue):
    with pytest.raises(usmipc.ArgumentError) as e:
        MemoryUSMDevice(-1, queue=queue)
    assert isinstance(e.value, ValueError) and isinstance(e.value, usmipc.Error)
    assert (e.value.code, e.value.name) == (usmipc.USMIPC_EINVAL,
                                            "USMIPC_EINVAL")
    with pytest.raises(usmipc.ArgumentTypeError) as e:
        usmipc.Device(3)
    assert isinstance(e.value, TypeError) and e.value.name == "USMIPC_EINVAL"
    mem = MemoryUSMDevice(64, queue=queue)
    # the extension's own keyword parsing
    with pytest.raises(usmipc.ArgumentTypeError, match="unexpected keyword"):
        mem.memset(val=1)
    with pytest.raises(usmipc.ArgumentTypeError, match="positional"):
        mem.copy_to_host(None, None)
    with pytest.raises(usmipc.ArgumentError, match="byte"):
        mem.memset(256)
    # CPython's own argument parsing (PyArg_ParseTupleAndKeywords), wrapped
    with pytest.raises(usmipc.ArgumentTypeError, match="nbytes"):
        MemoryUSMDevice(queue=queue)
    with pytest.raises(usmipc.ArgumentTypeError):
        usmipc.Queue(queue.sycl_device, nonsense=1)
    # ... and its conversions of scalar arguments
    with pytest.raises(usmipc.ArgumentTypeError):
        mem.memset("a")
    with pytest.raises(usmipc.ArgumentTypeError):
        usmipc.set_ipc_cache_size("many")
    with pytest.raises(usmipc.ArgumentTypeError):
        usmipc.set_ipc_timeout("soon")
    with pytest.raises(OverflowError):  # stays built-in
        usmipc.set_ipc_cache_size(1 << 80)
    # memory of the wrong kind
    if not mem.host_accessible:
        np = pytest.importorskip("numpy")
        with pytest.raises(usmipc.MemoryKindError) as e:
            np.asarray(mem)
        assert e.value.name == "USMIPC_EMEMKIND"
    # the Python layer's own
    with pytest.raises(usmipc.ArgumentTypeError) as e:
        usmipc.memory.SyclIPCGetMemHandle(bytearray(8))
    assert e.value.name == "USMIPC_EINVAL"
    with pytest.raises(usmipc.Error) as e:  # dpctl: RuntimeError
        IPCMemoryHandle.close_mapping(mem)
    assert isinstance(e.value, RuntimeError)
    assert e.value.name == "USMIPC_ENOTMAPPED"


# ---- copy_to_host -----------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_copy_to_host_returns_a_numpy_copy(queue, kind):
    np = pytest.importorskip("numpy")
    mem = KINDS[kind](1000, queue=queue)
    mem.copy_from_host(pattern(1000, 3))
    a = mem.copy_to_host()
    assert type(a) is np.ndarray and a.dtype == np.uint8 and a.shape == (1000,)
    assert a.tobytes() == pattern(1000, 3)
    assert a.flags.owndata and a.ctypes.data != mem._pointer  # a copy
    a[:] = 0
    assert mem.tobytes() == pattern(1000, 3) == bytes(mem)
    # into a buffer given: filled and returned, whatever its type
    out = np.zeros(1200, dtype=np.uint8)
    assert mem.copy_to_host(out) is out
    assert out[:1000].tobytes() == pattern(1000, 3) and not out[1000:].any()
    buf = bytearray(1000)
    assert mem.copy_to_host(obj=buf) is buf and bytes(buf) == pattern(1000, 3)
    with pytest.raises(usmipc.ArgumentError, match="too small"):
        mem.copy_to_host(np.zeros(999, dtype=np.uint8))
    with pytest.raises((ValueError, BufferError)):
        mem.copy_to_host(np.zeros(4000, dtype=np.uint8)[::2])  # strided
    with pytest.raises((TypeError, BufferError)):
        mem.copy_to_host(b"\0" * 1000)  # read-only


def test_copy_to_host_without_numpy_gives_a_bytearray():
    code = (
        "import sys; sys.modules['numpy'] = None\n"  # import numpy fails
        "from usmipc.memory import MemoryUSMDevice\n"
        "m = MemoryUSMDevice(16, device='host:cpu'); m.memset(9)\n"
        "a = m.copy_to_host(); b = m.copy_to_host()\n"
        "print(type(a).__name__, a == bytearray(b'\\t' * 16), a is not b)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["bytearray", "True", "True"]


# ---- __sycl_usm_array_interface__ and MemoryUSM*(obj) -----------------------


class USMArray:
    """Stands in for a dpctl.tensor.usm_ndarray or a dpnp array: only the
    interface, over memory it keeps alive."""

    def __init__(self, mem, shape, typestr="|u1", strides=None, offset=0,
                 **changes):
        self.mem = mem
        self.__sycl_usm_array_interface__ = dict(
            data=(mem._pointer, False), shape=shape, typestr=typestr,
            strides=strides, offset=offset, version=1,
            syclobj=mem.sycl_queue)
        self.__sycl_usm_array_interface__.update(changes)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_sycl_usm_array_interface(queue, kind):
    mem = KINDS[kind](96, queue=queue)
    iface = mem.__sycl_usm_array_interface__
    assert iface == {"data": (mem._pointer, False), "shape": (96,),
                     "strides": None, "typestr": "|u1", "version": 1,
                     "syclobj": mem.sycl_queue}
    assert iface["syclobj"].sycl_device == queue.sycl_device


def test_sycl_usm_array_interface_of_a_closed_mapping(queue):
    if not queue.sycl_device.has_aspect_ipc_memory:
        pytest.skip("no IPC on this device")
    mem = MemoryUSMDevice(64, queue=queue)
    m = IPCMemoryHandle.open(IPCMemoryHandle(mem).to_bytes(), queue)
    IPCMemoryHandle.close_mapping(m)
    iface = m.__sycl_usm_array_interface__  # hasattr() still answers
    assert iface["data"] == (0, False) and iface["shape"] == (0,)
    with pytest.raises(usmipc.ArgumentError, match="closed"):
        MemoryUSMDevice(m)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_memory_from_memory_is_zero_copy(queue, kind):
    cls = KINDS[kind]
    mem = cls(256, queue=queue)
    mem.copy_from_host(pattern(256, 1))
    view = cls(mem)
    assert type(view) is cls and view.reference_obj is mem
    assert mem.reference_obj is None
    assert (view._pointer, view.nbytes) == (mem._pointer, 256)
    assert view.get_usm_type() == kind and view.sycl_device == mem.sycl_device
    view.memset(0x2A)  # the same memory
    assert mem.tobytes() == b"\x2a" * 256
    assert cls(mem, copy=True)._pointer == mem._pointer  # same kind: a view
    del mem
    gc.collect()
    assert view.tobytes() == b"\x2a" * 256  # kept alive by the view


@pytest.mark.parametrize("src_kind", sorted(KINDS))
def test_memory_of_another_kind_copies_only_if_asked(queue, src_kind):
    src = KINDS[src_kind](128, queue=queue)
    src.copy_from_host(pattern(128, 2))
    for kind, cls in KINDS.items():
        if kind == src_kind:
            continue
        with pytest.raises(usmipc.ArgumentError, match="copy=True") as e:
            cls(src)
        assert f"USM {src_kind} memory, not {kind}" in str(e.value)
        got = cls(src, copy=True)
        assert type(got) is cls and got.get_usm_type() == kind
        assert got._pointer != src._pointer and got.reference_obj is None
        assert got.tobytes() == pattern(128, 2)
        assert got.sycl_device == src.sycl_device


def test_memory_from_an_array_interface(queue):
    base = MemoryUSMDevice(4096, queue=queue)
    base.copy_from_host(pattern(4096, 3))
    # 3 x 4 float32 starting 16 elements in: bytes 64 .. 112
    arr = USMArray(base, (3, 4), typestr="<f4", offset=16)
    view = MemoryUSMDevice(arr)
    assert view.reference_obj is arr
    assert (view._pointer - base._pointer, view.nbytes) == (64, 48)
    assert view.tobytes() == pattern(4096, 3)[64:112]
    # strides in elements, a negative one: the lowest to the highest byte
    arr = USMArray(base, (2, 3), typestr="<i8", strides=(-3, 1), offset=10)
    view = MemoryUSMDevice(arr)
    assert (view._pointer - base._pointer, view.nbytes) == (7 * 8, 6 * 8)
    # syclobj as a Device or a filter string
    for syclobj in (queue.sycl_device, queue.sycl_device.filter_string):
        view = MemoryUSMDevice(USMArray(base, (16,), syclobj=syclobj))
        assert view.nbytes == 16 and view.sycl_device == queue.sycl_device
    # the queue given orders the view's copies
    q2 = usmipc.Queue(queue.sycl_device)
    assert MemoryUSMDevice(base, queue=q2).sycl_queue is q2


def test_malformed_or_foreign_interfaces_are_refused(queue):
    base = MemoryUSMDevice(4096, queue=queue)
    bad = [
        (dict(version=2), "version"),
        (dict(version=None), "version"),
        (dict(data=(base._pointer,)), "'data'"),
        (dict(typestr="|O8"), "typestr"),
        (dict(typestr=4), "typestr"),
        (dict(shape=(-1,)), "negative"),
        (dict(shape="16"), "shape"),
        (dict(shape=(0,)), "no element"),
        (dict(strides=(1, 1)), "strides"),
        (dict(syclobj=object()), "another SYCL runtime"),
        (dict(syclobj=None), "syclobj"),
        (dict(shape=(4097,)), "pass the end"),
        # (on CUDA the byte before may be another allocation's last)
        (dict(offset=-1), "usmipc does not know|pass the end"),
    ]
    for changes, message in bad:
        fields = dict(shape=(16,), **changes) if "shape" not in changes \
            else changes
        with pytest.raises(usmipc.ArgumentError, match=message):
            MemoryUSMDevice(USMArray(base, **fields))
    np = pytest.importorskip("numpy")
    host = np.zeros(16, dtype=np.uint8)  # memory usmipc did not allocate
    with pytest.raises(usmipc.ArgumentError, match="not memory of"):
        MemoryUSMDevice(USMArray(base, (16,), data=(host.ctypes.data, False)))
    other = "level_zero:gpu" if queue.sycl_device.backend == "host" \
        else "host:cpu"
    if usmipc.get_num_devices(backend=other.split(":")[0]):
        with pytest.raises(usmipc.ArgumentError, match="not memory of"):
            MemoryUSMDevice(USMArray(base, (16,), syclobj=other))

    class NotADict:
        __sycl_usm_array_interface__ = [1, 2]
    for obj in (NotADict(), 1.5, object(), b"bytes"):
        with pytest.raises(usmipc.ArgumentError, match="interface"):
            MemoryUSMDevice(obj)
    with pytest.raises(usmipc.ArgumentError, match="alignment"):
        MemoryUSMDevice(base, alignment=64)
    host_dev = usmipc.Device("host:cpu")
    if host_dev != queue.sycl_device:
        with pytest.raises(usmipc.ArgumentError, match="not on the device"):
            MemoryUSMDevice(base, device=host_dev)


EXPORTER = PATTERN_SRC + """
import sys
from usmipc.memory import IPCMemoryHandle, MemoryUSMDevice
mem = MemoryUSMDevice(4096)  # on the default device
mem.copy_from_host(pattern(4096, 4))
print(IPCMemoryHandle(mem).to_bytes().hex(), flush=True)
sys.stdin.read()  # until the test is done
"""


def test_a_view_keeps_a_closed_mapping_mapped(queue, no_ipc_cache):
    """A view of a mapping holds one of its exports, as a memoryview does:
    closing the mapping unmaps it only when the view is gone."""
    if not queue.sycl_device.has_aspect_ipc_memory:
        pytest.skip("no IPC on this device")
    child = subprocess.Popen([sys.executable, "-c", EXPORTER],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        raw = bytes.fromhex(child.stdout.readline().strip())
        m = IPCMemoryHandle.open(raw, queue)
        view = MemoryUSMDevice(m)
        assert isinstance(m, MemoryIPCDevice)
        assert not isinstance(view, MemoryIPCDevice)
        address = m._pointer
        m.close()
        assert m.is_closed and not view.is_closed and is_known(address)
        assert view.tobytes() == pattern(4096, 4)  # still mapped
        del view
        gc.collect()
        assert not is_known(address)  # unmapped with the view
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def test_ipc_handle_of_a_view(queue):
    if not queue.sycl_device.has_aspect_ipc_memory:
        pytest.skip("no IPC on this device")
    base = MemoryUSMDevice(8192, queue=queue)
    base.copy_from_host(pattern(8192, 5))
    view = MemoryUSMDevice(USMArray(base, (1024,), offset=4096))
    m = IPCMemoryHandle.open(IPCMemoryHandle(view).to_bytes(), queue)
    assert m.nbytes == 1024 and m.tobytes() == pattern(8192, 5)[4096:5120]
    m.close()


# ---- copy_from_device -------------------------------------------------------


def test_copy_from_device(queue):
    dst = MemoryUSMDevice(1024, queue=queue)
    dst.memset(0)
    for kind, cls in KINDS.items():
        src = cls(512, queue=queue)
        src.copy_from_host(pattern(512, 6))
        assert dst.copy_from_device(src) is None
        assert dst.tobytes() == pattern(512, 6) + bytes(512)
    base = MemoryUSMShared(2048, queue=queue)
    base.copy_from_host(pattern(2048, 7))
    dst.copy_from_device(USMArray(base, (8, 8), typestr="<u2", offset=100))
    assert dst.tobytes()[:128] == pattern(2048, 7)[200:328]
    with pytest.raises(usmipc.ArgumentError, match="do not fit"):
        dst.copy_from_device(MemoryUSMDevice(1025, queue=queue))
    with pytest.raises(usmipc.ArgumentError, match="interface"):
        dst.copy_from_device(bytearray(16))
    with pytest.raises(usmipc.ArgumentError, match="version"):
        dst.copy_from_device(USMArray(base, (8,), version=3))


def test_copy_from_device_across_devices(queue):
    """Memory of another device comes through the host (dpctl's
    copy_via_host for memory of another context)."""
    here = queue.sycl_device
    others = [d for d in usmipc.get_devices() if d != here]
    if not others:
        pytest.skip("one device only")
    for other in others:
        src = MemoryUSMDevice(300, device=other)
        src.copy_from_host(pattern(300, 8))
        dst = MemoryUSMDevice(300, queue=queue)
        dst.copy_from_device(src)
        assert dst.tobytes() == pattern(300, 8)
        back = MemoryUSMHost(src, copy=True, device=here)  # the same way
        assert back.sycl_device == here and back.tobytes() == pattern(300, 8)


# ---- DLPack to NumPy --------------------------------------------------------


def _capsule_tensor(capsule):
    """(flags, data address, device) of an unconsumed versioned capsule."""
    import ctypes
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object,
                                                  ctypes.c_char_p]
    p = get(capsule, b"dltensor_versioned")
    # DLManagedTensorVersioned: version (8), manager_ctx, deleter, flags,
    # then DLTensor: data, device (type, id)
    flags = ctypes.c_uint64.from_address(p + 24).value
    data = ctypes.c_void_p.from_address(p + 32).value
    device = (ctypes.c_int32.from_address(p + 40).value,
              ctypes.c_int32.from_address(p + 44).value)
    return flags, data, device


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dlpack_to_numpy(queue, kind):
    np = pytest.importorskip("numpy")
    mem = KINDS[kind](256, queue=queue)
    mem.copy_from_host(pattern(256, 9))
    native = mem.__dlpack_device__()
    if mem.host_accessible:
        a = np.from_dlpack(mem, device="cpu")  # dl_device=(1, 0): no copy
        assert a.ctypes.data == mem._pointer and a.tobytes() == pattern(256, 9)
        a[0] = 0xEE
        assert mem.tobytes()[0] == 0xEE
        flags, data, device = _capsule_tensor(
            mem.__dlpack__(max_version=(1, 0), dl_device=(1, 0), copy=False))
        assert (flags & 2, data, device) == (0, mem._pointer, (1, 0))
        if native == (1, 0):
            assert np.from_dlpack(mem).ctypes.data == mem._pointer
    else:
        for copy in (None, False):
            with pytest.raises(BufferError, match="copy=True"):
                mem.__dlpack__(dl_device=(1, 0), copy=copy)
        with pytest.raises(BufferError):
            np.from_dlpack(mem, device="cpu")
    expected = mem.tobytes()
    c = np.from_dlpack(mem, device="cpu", copy=True)  # always a copy
    assert c.ctypes.data != mem._pointer and c.tobytes() == expected
    c[:] = 0
    assert mem.tobytes() == expected
    flags, data, device = _capsule_tensor(
        mem.__dlpack__(max_version=(1, 0), dl_device=(1, 0), copy=True))
    assert flags & 2 and data != mem._pointer and device == (1, 0)
    # copy=True on the memory's own device: a new allocation there
    capsule = mem.__dlpack__(max_version=(1, 0), copy=True)
    flags, data, device = _capsule_tensor(capsule)
    assert flags & 2 and data != mem._pointer and device == native
    if mem.host_accessible or queue.sycl_device.name == ZE_TEST_DEVICE:
        import ctypes  # (the test driver's device memory is host memory)
        assert ctypes.string_at(data, 256) == expected
    del capsule  # never consumed: its destructor frees the copy
    gc.collect()
    with pytest.raises(BufferError, match="not to"):
        mem.__dlpack__(dl_device=(native[0] + 100, 0))
    with pytest.raises(BufferError, match="stream"):
        mem.__dlpack__(dl_device=(1, 0), stream=7, copy=True)


# ---- the same on level_zero:gpu ---------------------------------------------


@skip_unless_level_zero_rerun
def test_the_same_on_level_zero_with_no_skip():
    rerun_on_level_zero(__file__)
