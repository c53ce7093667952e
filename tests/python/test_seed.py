"""The seed's example (the dpctl pull request's test run) as its text stands,
with the word dpctl replaced by usmipc and nothing else changed: it must run
and print the seed's three lines, apart from the handle's length and the
device's name. On level_zero:gpu through the project's test driver, as
written; on host:cpu with the filter string swapped."""
import ctypes.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DRIVER = pathlib.Path(os.environ.get(
    "USMIPC_ZE_TEST_DRIVER",
    ROOT / "build" / "tests" / "level_zero" / "libze_usmipc_test_driver.so"))

# The seed's snippet, verbatim (../shared/seed/000_23f2e55a637c41e7.txt).
SEED = """\
import dpctl
from dpctl.memory import MemoryUSMDevice
from dpctl.ipc import IPCMemoryHandle
d = dpctl.SyclDevice('level_zero:gpu')
q = dpctl.SyclQueue(d)
mem = MemoryUSMDevice(4096, queue=q)
h = IPCMemoryHandle(mem)
raw = h.to_bytes()
print(f'IPC handle: {len(raw)} bytes')
mem2 = IPCMemoryHandle.open(raw, d, nbytes=4096)
print(f'Opened: {mem2.nbytes} bytes on {mem2.sycl_device.name}')
IPCMemoryHandle.close_mapping(mem2)
print('close OK')
"""


def run_seed(text, **env):
    result = subprocess.run([sys.executable, "-c", text], capture_output=True,
                            text=True, timeout=120,
                            env=dict(os.environ, **env), cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3, lines
    assert re.fullmatch(r"IPC handle: \d+ bytes", lines[0]), lines[0]
    assert re.fullmatch(r"Opened: 4096 bytes on .+", lines[1]), lines[1]
    assert lines[2] == "close OK"
    return lines


def test_seed_text_on_host():
    text = SEED.replace("dpctl", "usmipc").replace("'level_zero:gpu'",
                                                   "'host:cpu'")
    run_seed(text)


@pytest.mark.skipif(ctypes.util.find_library("ze_loader") is None,
                    reason="no Level Zero loader (apt-get install libze1)")
@pytest.mark.skipif(not DRIVER.exists(),
                    reason=f"test driver not built at {DRIVER} (make build)")
def test_seed_text_on_level_zero_as_written():
    lines = run_seed(SEED.replace("dpctl", "usmipc"),
                     ZE_ENABLE_ALT_DRIVERS=str(DRIVER))
    assert lines[1].endswith("usmipc Level Zero test device")


def test_mapping_is_device_memory():
    import usmipc
    from usmipc.ipc import IPCMemoryHandle, is_available
    from usmipc.memory import MemoryIPCDevice, MemoryUSMDevice
    assert usmipc.SyclDevice is usmipc.Device
    assert usmipc.SyclQueue is usmipc.Queue
    assert issubclass(MemoryIPCDevice, MemoryUSMDevice)
    d = usmipc.SyclDevice("host:cpu")
    assert is_available(d)
    mem = MemoryUSMDevice(64, device=d)
    m = IPCMemoryHandle.open(handle_bytes=IPCMemoryHandle(mem).to_bytes(),
                             device=d, nbytes=64)
    assert isinstance(m, MemoryUSMDevice) and isinstance(m, MemoryIPCDevice)
    IPCMemoryHandle.close_mapping(m)
    with pytest.raises(TypeError):
        MemoryIPCDevice(64)
