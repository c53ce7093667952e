"""dpctl parity where a ported program would notice (issue 12): device
attributes a user prints, the extension's own argument errors as
usmipc.Error subclasses, __sycl_usm_array_interface__ and construction
from it, copy_to_host() and copy_from_device(), DLPack to NumPy.

The tests run on the default device: host:cpu here, and level_zero:gpu
through the test driver when run again with USMIPC_DEFAULT_DEVICE (the
last test does that, and requires that no test skips there)."""
import ctypes.util
import gc
import os
import pathlib
import subprocess
import sys

import pytest

import usmipc
from usmipc.memory import (IPCMemoryHandle, MemoryIPCDevice, MemoryUSMDevice,
                           MemoryUSMHost, MemoryUSMShared)

from conftest import pattern

ROOT = pathlib.Path(__file__).resolve().parents[2]
DRIVER = pathlib.Path(os.environ.get(
    "USMIPC_ZE_TEST_DRIVER",
    ROOT / "build" / "tests" / "level_zero" / "libze_usmipc_test_driver.so"))
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
        # the test driver (ideal profile): driverVersion 1 as SYCL prints
        # it, two memories of 3 GiB summed, maxMemAllocSize 1 GiB
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
