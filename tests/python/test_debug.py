"""USMIPC_DEBUG=1 logs one line per decision to stderr (backends probed and
why one is unavailable, each open's cache hit or miss, how the descriptor
came), and malformed values of USMIPC_* variables are reported, never
silently ignored."""
import os
import subprocess
import sys

import usmipc
from usmipc.memory import IPCMemoryHandle, MemoryUSMDevice

CHILD = """
import sys, usmipc
from usmipc.memory import IPCMemoryHandle
raw = bytes.fromhex(sys.argv[1])
for _ in range(2):
    m = IPCMemoryHandle.open(raw, usmipc.Device("host:cpu"))
    assert bytes(m.copy_to_host())[:2] == b"ok"
    IPCMemoryHandle.close_mapping(m)
usmipc.get_devices()
"""


def run_child(raw, **env):
    return subprocess.run([sys.executable, "-c", CHILD, raw.hex()],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **env))


def test_debug_lines():
    mem = MemoryUSMDevice(64, device=usmipc.Device("host:cpu"))
    mem.copy_from_host(b"ok")
    raw = IPCMemoryHandle(mem).to_bytes()
    r = run_child(raw, USMIPC_DEBUG="1")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("usmipc[")]
    text = "\n".join(lines)
    assert "backend host: 1 device(s)" in text
    assert "backend cuda unavailable: " in text or "backend cuda: " in text
    assert "open: cache miss" in text and "open: cache hit" in text
    assert "descriptor of buffer" in text
    quiet = run_child(raw)
    assert quiet.returncode == 0 and "usmipc[" not in quiet.stderr


def test_malformed_settings_are_reported():
    mem = MemoryUSMDevice(64, device=usmipc.Device("host:cpu"))
    mem.copy_from_host(b"ok")
    raw = IPCMemoryHandle(mem).to_bytes()
    r = run_child(raw, USMIPC_IPC_CACHE_SIZE="lots",
                  USMIPC_IPC_TIMEOUT_MS="-5", USMIPC_CUDA_IPC="nativ",
                  USMIPC_DEBUG="yes")
    assert r.returncode == 0, r.stderr
    for name in ("USMIPC_IPC_CACHE_SIZE='lots'", "USMIPC_IPC_TIMEOUT_MS='-5'",
                 "USMIPC_CUDA_IPC='nativ'", "USMIPC_DEBUG='yes'"):
        assert f"warning: {name} is malformed" in r.stderr, r.stderr
