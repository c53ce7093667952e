"""python -m usmipc, its demo, and the seed's example on the host backend."""

import subprocess
import sys

import pytest

import usmipc

from conftest import TIMEOUT, child_env, run_python


def run_module(*args, env=None):
    return subprocess.run([sys.executable, "-m", "usmipc", *args],
                          capture_output=True, text=True, env=env,
                          timeout=TIMEOUT)


def test_info_lists_backends_and_devices(host):
    result = run_module()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "backends:" in out and "devices:" in out
    assert "host" in out and "available" in out
    for name, (available, reason) in usmipc.backends().items():
        if not available:
            assert reason in out
    assert host.filter_string in out and host.name in out
    assert "ipc=yes" in out
    assert str(__import__("uuid").UUID(bytes=host.uuid)) in out


@pytest.mark.parametrize("transport", [None, "socket"])
def test_demo_on_the_host(transport, host):
    env = child_env(USMIPC_FD_TRANSPORT=transport) if transport else None
    result = run_module("demo", "--device", "host:cpu", "--nbytes", "100000",
                        "--reopen", "100", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.rstrip().endswith("demo OK")
    # ordered by default: the 216 bytes of a host handle and the 72-byte
    # record of the event importers wait for
    assert "handle size:  288 bytes" in out
    assert f"opened size:  100000 bytes on {host.name}" in out
    assert f"fd transport: {transport or 'auto'}" in out
    for label in ("export:", "open:", "re-open:", "close:"):
        assert label in out


def test_demo_reports_set_up_apart_and_warm_figures(host):
    """The first figures a user sees: one-time set-up on lines of its own,
    and every operation first and warm (median over fresh allocations)."""
    result = run_module("demo", "--device", "host:cpu", "--nbytes", "4096",
                        "--reopen", "10", "--warm", "5")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    import re
    assert "one-time set-up, once per process" in out
    assert re.search(r"parent: +[0-9.]+ us \(device context", out), out
    assert re.search(r"child: +[0-9.]+ us \(device context\)", out), out
    assert "first in the process and then warm (median of 5)" in out
    export = re.search(r"export: +([0-9.]+) us first .*, ([0-9.]+) us warm",
                       out)
    opened = re.search(r"open: +([0-9.]+) us first .*, ([0-9.]+) us warm",
                       out)
    assert export and opened, out
    assert all(float(v) > 0 for v in export.groups() + opened.groups())


def test_demo_with_a_bad_device_fails():
    result = run_module("demo", "--device", "nonsense")
    assert result.returncode == 2
    assert "nonsense" in result.stderr


SEED_EXAMPLE = """
import usmipc
from usmipc.memory import MemoryUSMDevice, IPCMemoryHandle
d = usmipc.Device('host:cpu')
q = usmipc.Queue(d)
mem = MemoryUSMDevice(4096, queue=q)
h = IPCMemoryHandle(mem)
raw = h.to_bytes()
print(f'IPC handle: {len(raw)} bytes')
mem2 = IPCMemoryHandle.open(raw, d, nbytes=4096)
print(f'Opened: {mem2.nbytes} bytes on {mem2.sycl_device.name}')
IPCMemoryHandle.close_mapping(mem2)
print('close OK')
"""


def test_seed_example_on_the_host(host):
    result = run_python(SEED_EXAMPLE)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().splitlines() == [
        "IPC handle: 288 bytes",  # 216 + the ordering record
        f"Opened: 4096 bytes on {host.name}",
        "close OK",
    ]
