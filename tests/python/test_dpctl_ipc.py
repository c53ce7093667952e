"""dpctl's merged IPC API (dpctl.memory: SyclIPCGetMemHandle,
SyclIPCOpenMemHandle, SyclIPCCloseMemHandle, MemoryIPCDevice) as a dpctl
program uses it, on the default device: host:cpu here, and level_zero:gpu
through the test driver when run again with USMIPC_DEFAULT_DEVICE (the last
test does that, and requires no test to skip there)."""
import gc
import os
import subprocess
import sys

import pytest

import usmipc
from usmipc.memory import (IPCMemoryHandle, MemoryIPCDevice, MemoryUSMDevice,
                           MemoryUSMHost, MemoryUSMShared,
                           SyclIPCCloseMemHandle, SyclIPCGetMemHandle,
                           SyclIPCOpenMemHandle)

from conftest import rerun_on_level_zero, skip_unless_level_zero_rerun


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


@skip_unless_level_zero_rerun
def test_the_same_on_level_zero_with_no_skip():
    rerun_on_level_zero(__file__)


def test_handle_close(queue):
    """IPCMemoryHandle.close(): no more bytes (RuntimeError); the bytes
    already sent of usmipc's own memory stay valid while it lives."""
    mem = MemoryUSMDevice(4096, queue=queue)
    h = IPCMemoryHandle(mem)
    raw = h.to_bytes()
    h.close()
    h.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        h.to_bytes()
    with pytest.raises(RuntimeError, match="closed"):
        import pickle
        pickle.dumps(h)
    assert h.memory is None  # no longer keeps the memory alive
    m = SyclIPCOpenMemHandle(raw, queue.sycl_device, 4096)
    assert m.nbytes == 4096
    SyclIPCCloseMemHandle(m)


def test_one_exception_root(queue):
    """The library's errors are usmipc.Error, and the built-in kind Python
    code expects, with .code and .name."""
    with pytest.raises(usmipc.ArgumentError) as e:
        IPCMemoryHandle.open(b"\x89USMIPC\n" + bytes(300))
    assert isinstance(e.value, usmipc.Error) and isinstance(e.value, ValueError)
    # (version 0 in the header: a bad handle, told as a version mismatch)
    assert e.value.name in ("USMIPC_EBADHANDLE", "USMIPC_EHANDLEVERSION")
    assert e.value.code < 0
    with pytest.raises(usmipc.MemoryKindError) as e:
        IPCMemoryHandle(MemoryUSMShared(64, queue=queue))
    assert isinstance(e.value, TypeError) and e.value.name == "USMIPC_EMEMKIND"
    assert issubclass(usmipc.OutOfMemoryError, MemoryError)
    assert issubclass(usmipc.SyclDeviceCreationError, usmipc.ArgumentError)


def test_version_at_the_prompt():
    out = subprocess.run([sys.executable, "-m", "usmipc", "--version"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == \
        f"usmipc {usmipc.__version__}"
    help_text = subprocess.run([sys.executable, "-m", "usmipc", "--help"],
                               capture_output=True, text=True,
                               timeout=60).stdout
    assert "_demo_child" not in help_text  # internal subcommands stay hidden
    bad = subprocess.run([sys.executable, "-m", "usmipc", "nosuch"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "_demo_child" not in bad.stderr


def test_numpy_of_a_closed_mapping_raises():
    np = pytest.importorskip("numpy")
    d = usmipc.Device("host:cpu")
    mem = MemoryUSMDevice(64, device=d)
    mem.memset(7)
    m = IPCMemoryHandle.open(IPCMemoryHandle(mem).to_bytes(), d)
    assert np.asarray(m)[3] == 7
    IPCMemoryHandle.close_mapping(m)
    with pytest.raises(ValueError, match="closed"):
        np.asarray(m)


def test_device_parity(capsys):
    d = usmipc.select_default_device()
    assert d == usmipc.Device()
    host = usmipc.Device("host:cpu")
    assert host.has_aspect_cpu and not host.has_aspect_gpu
    assert isinstance(host.vendor, str) and host.vendor
    host.print_device_info()
    out = capsys.readouterr().out
    assert "host:cpu:0" in out and "IPC memory" in out and host.name in out
    n = usmipc.get_num_devices()
    assert n == len(usmipc.get_devices()) >= 1
    assert usmipc.get_num_devices(backend="host") == 1
    assert usmipc.has_cpu_devices()
    assert usmipc.has_gpu_devices() == (usmipc.get_num_devices(
        device_type="gpu") > 0)


def test_alignment_and_usm_type(queue):
    m = MemoryUSMDevice(100, 256, queue=queue)  # dpctl: alignment second
    assert m._pointer % 256 == 0
    assert MemoryUSMShared(64, alignment=64, queue=queue)._pointer % 64 == 0
    with pytest.raises(ValueError, match="power of two"):
        MemoryUSMDevice(64, alignment=3, queue=queue)
    with pytest.raises(ValueError, match="alignment"):
        MemoryUSMDevice(64, alignment=1 << 40, queue=queue)
    assert m.get_usm_type() == "device"
    assert m.get_usm_type(queue) == "device"
    assert MemoryUSMHost(64, queue=queue).get_usm_type(syclobj=None) == "host"
