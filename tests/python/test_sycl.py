"""IPCMemoryHandle.open_sycl: memory that a SYCL program (dpctl) exported,
from the bytes of its IPC handle (a UMF blob of 108 or 120 bytes), opened in
a usmipc process. The exporter is tests/level_zero/test_sycl_blob --export:
it allocates through the Level Zero loader and the project's test driver and
lays the blobs out as UMF does (tests/level_zero/test_sycl_umf.c checks
blobs that UMF itself makes). What this verifies: the Python entry point,
its arguments and errors; not an Intel driver."""
import ctypes.util
import os
import pathlib
import subprocess
import sys

import pytest

import usmipc

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "tests" / "level_zero"
DRIVER = BUILD / "libze_usmipc_test_driver.so"
EXPORTER = BUILD / "test_sycl_blob"

needs_driver = [
    pytest.mark.skipif(ctypes.util.find_library("ze_loader") is None,
                       reason="no Level Zero loader (apt-get install libze1)"),
    pytest.mark.skipif(not (DRIVER.exists() and EXPORTER.exists()),
                       reason=f"test driver not built in {BUILD} (make build)"),
]

IMPORTER = r"""
import sys, usmipc
blob = bytes.fromhex(sys.argv[1])
m = usmipc.memory.IPCMemoryHandle.open_sycl(blob)
view = bytes(m.copy_to_host())
size, offset = 256 * 1024, 4096 + 3
assert len(view) == size - offset, len(view)
for i in (0, 1, 997, len(view) - 1):
    want = ((offset + i) * 7 + 11) & 0xff
    assert view[i] == want, (i, view[i], want)
assert isinstance(m, usmipc.memory.MemoryIPCDevice), type(m)
half = usmipc.memory.IPCMemoryHandle.open_sycl(blob, nbytes=100)
assert half.nbytes == 100, half.nbytes
usmipc.memory.IPCMemoryHandle.close_mapping(half)
del view
usmipc.memory.IPCMemoryHandle.close_mapping(m)
print("ok")
"""


@pytest.mark.parametrize("layout", [{}, {"USMIPC_ZE_TEST_PIDFD_HANDLE": "1"}])
def test_open_sycl_blob(layout):
    for mark in needs_driver:
        if mark.args[0]:
            pytest.skip(mark.kwargs["reason"])
    env = dict(os.environ, ZE_ENABLE_ALT_DRIVERS=str(DRIVER),
               USMIPC_ZE_TEST_NO_PUT="1", **layout)
    exporter = subprocess.Popen([str(EXPORTER), "--export"], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
    try:
        blobs = [exporter.stdout.readline().strip() for _ in range(3)]
        assert all(blobs), "the exporter wrote no blobs"
        for blob in blobs[:2]:
            result = subprocess.run([sys.executable, "-c", IMPORTER, blob],
                                    env=env, capture_output=True, text=True,
                                    timeout=60)
            assert result.stdout.strip() == "ok", result.stderr
        # Host memory is refused with its reason.
        result = subprocess.run(
            [sys.executable, "-c",
             "import sys, usmipc\n"
             "try:\n"
             "    usmipc.memory.IPCMemoryHandle.open_sycl(bytes.fromhex(sys.argv[1]))\n"
             "except Exception as e:\n"
             "    print(e)\n", blobs[2]],
            env=env, capture_output=True, text=True, timeout=60)
        assert "host memory" in result.stdout, result.stdout + result.stderr
    finally:
        exporter.stdin.close()
        exporter.wait(timeout=30)


def test_open_sycl_refuses_what_is_not_a_sycl_blob():
    with pytest.raises((usmipc.Error, ValueError), match="108"):
        usmipc.memory.IPCMemoryHandle.open_sycl(b"\0" * 107, device="host:cpu")
    dev = usmipc.Device("host:cpu")
    mem = usmipc.memory.MemoryUSMDevice(4096, device=dev)
    raw = usmipc.memory.IPCMemoryHandle(mem).to_bytes()
    with pytest.raises((usmipc.Error, ValueError),
                       match=r"open them with IPCMemoryHandle\.open\(\)"):
        usmipc.memory.IPCMemoryHandle.open_sycl(raw)
    blob = bytearray(120)
    blob[16:20] = (4242).to_bytes(4, "little")
    blob[24:32] = (4096).to_bytes(8, "little")
    blob[40:44] = (4242).to_bytes(4, "little")
    blob[48:56] = (4096).to_bytes(8, "little")
    with pytest.raises((usmipc.Error, ValueError), match="level_zero"):
        usmipc.memory.IPCMemoryHandle.open_sycl(bytes(blob), device="host:cpu")
    with pytest.raises(TypeError):
        usmipc.memory.IPCMemoryHandle.open_sycl(42)
