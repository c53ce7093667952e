"""dpctl's merged IPC API (dpctl.memory: SyclIPCGetMemHandle,
SyclIPCOpenMemHandle, SyclIPCCloseMemHandle, MemoryIPCDevice) as a dpctl
program uses it, on the default device: host:cpu here, and level_zero:gpu
through the test driver when run again with USMIPC_DEFAULT_DEVICE (the last
test does that, and requires no test to skip there)."""
import ctypes.util
import gc
import os
import pathlib
import subprocess
import sys

import pytest

import usmipc
from usmipc.memory import (IPCMemoryHandle, MemoryIPCDevice, MemoryUSMDevice,
                           MemoryUSMHost, MemoryUSMShared,
                           SyclIPCCloseMemHandle, SyclIPCGetMemHandle,
                           SyclIPCOpenMemHandle)

ROOT = pathlib.Path(__file__).resolve().parents[2]
DRIVER = pathlib.Path(os.environ.get(
    "USMIPC_ZE_TEST_DRIVER",
    ROOT / "build" / "tests" / "level_zero" / "libze_usmipc_test_driver.so"))


@pytest.fixture
def queue():
    try:
        dev = usmipc.SyclDevice()
    except usmipc.SyclDeviceCreationError as e:
        pytest.skip(f"no default device: {e}")
    if not dev.has_aspect_ext_oneapi_ipc_memory:
        pytest.skip(f"{dev} has no IPC")
    return usmipc.SyclQueue(dev)


def opened(queue, n=4096):
    mem = MemoryUSMDevice(n, queue=queue)
    return mem, SyclIPCOpenMemHandle(SyclIPCGetMemHandle(mem),
                                     queue.sycl_device, n)


def test_handle_bytes_of_device_memory_only(queue):
    raw = SyclIPCGetMemHandle(MemoryUSMDevice(1024, queue=queue))
    assert isinstance(raw, bytes) and len(raw) > 0
    for kind in (MemoryUSMShared, MemoryUSMHost):
        with pytest.raises(TypeError):
            SyclIPCGetMemHandle(kind(1024, queue=queue))
    with pytest.raises(TypeError, match="keep an IPCMemoryHandle"):
        SyclIPCGetMemHandle(bytearray(16))


def test_open_gives_device_memory_and_close_empties_it(queue):
    mem, m = opened(queue)
    assert isinstance(m, MemoryIPCDevice) and isinstance(m, MemoryUSMDevice)
    assert m.nbytes == 4096 and m._pointer != 0 and m.is_closed is False
    SyclIPCCloseMemHandle(m)
    assert (m._pointer, m.nbytes, m.is_closed) == (0, 0, True)
    assert isinstance(m, MemoryIPCDevice)  # the type stays
    SyclIPCCloseMemHandle(m)  # idempotent
    del m
    gc.collect()
    assert mem.nbytes == 4096


def test_close_refuses_memory_that_is_no_mapping(queue):
    mem = MemoryUSMDevice(1024, queue=queue)
    with pytest.raises(RuntimeError, match="non-IPC"):
        SyclIPCCloseMemHandle(mem)
    with pytest.raises(usmipc.Error):
        SyclIPCCloseMemHandle(mem)
    with pytest.raises(TypeError):
        SyclIPCCloseMemHandle(b"not memory")
    for kind in (MemoryUSMDevice, MemoryUSMShared, MemoryUSMHost):
        assert not isinstance(kind(64, queue=queue), MemoryIPCDevice)


def test_each_open_is_its_own_mapping(queue):
    mem = MemoryUSMDevice(4096, queue=queue)
    raw = SyclIPCGetMemHandle(mem)
    dev = queue.sycl_device
    a = SyclIPCOpenMemHandle(raw, dev, 4096)
    b = SyclIPCOpenMemHandle(raw, dev, 4096)
    SyclIPCCloseMemHandle(a)
    assert b._pointer != 0 and b.nbytes == 4096
    SyclIPCCloseMemHandle(b)
    c = SyclIPCOpenMemHandle(raw, dev, 2048)
    assert c.nbytes == 2048
    del c  # collection closes it
    gc.collect()
    assert mem.nbytes == 4096


def test_device_creation_error():
    with pytest.raises(usmipc.SyclDeviceCreationError) as e:
        usmipc.SyclDevice("level_zero:gpu:77")
    assert isinstance(e.value, usmipc.Error) and e.value.name
    with pytest.raises(ValueError):  # also a ValueError, as before
        usmipc.SyclDevice("not-a-filter:::")
    assert IPCMemoryHandle.is_available()


def test_default_device_from_the_environment():
    code = ("import usmipc; print(usmipc.SyclDevice().filter_string)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=60,
                         env=dict(os.environ, USMIPC_DEFAULT_DEVICE="host:cpu"))
    assert out.stdout.strip() == "host:cpu:0", out.stderr
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=60,
                         env=dict(os.environ, USMIPC_DEFAULT_DEVICE="gpu:99"))
    assert bad.returncode != 0
    assert "USMIPC_DEFAULT_DEVICE='gpu:99'" in bad.stderr


@pytest.mark.skipif(ctypes.util.find_library("ze_loader") is None or
                    not DRIVER.exists() or
                    os.environ.get("USMIPC_DEFAULT_DEVICE") is not None,
                    reason="no Level Zero loader or test driver (or nested)")
def test_the_same_on_level_zero_with_no_skip():
    env = dict(os.environ, ZE_ENABLE_ALT_DRIVERS=str(DRIVER),
               USMIPC_DEFAULT_DEVICE="level_zero:gpu")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs",
                        "-p", "no:cacheprovider", "-k",
                        "not the_same_on_level_zero", __file__],
                       capture_output=True, text=True, timeout=300, env=env,
                       cwd=pathlib.Path(__file__).parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "skipped" not in r.stdout.splitlines()[-1], r.stdout
