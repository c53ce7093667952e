"""USMIPC_* numbers from the environment: one parser and one rule (a bad
value warns, naming the variable, the value, the form expected and what is
used instead; it never stops the program). The sizes of the trial:
USMIPC_IPC_CACHE_BYTES=64G is a size like USMIPC_TORCH_POOL_SEGMENT=40G."""
import os

import pytest

from conftest import run_python

OPEN = """
import usmipc
from usmipc.memory import MemoryUSMDevice, IPCMemoryHandle
d = usmipc.Device("host:cpu")
m = MemoryUSMDevice(4096, device=d)
m2 = IPCMemoryHandle.open(IPCMemoryHandle(m).to_bytes(), d)  # reads the cache settings
IPCMemoryHandle.close_mapping(m2)
print("ok")
"""


def _run(**env):
    full = dict(os.environ, **env)
    r = run_python(OPEN, env=full)
    return r.returncode, r.stdout.decode(), r.stderr.decode()


@pytest.mark.parametrize("name,value", [
    ("USMIPC_IPC_CACHE_BYTES", "64G"), ("USMIPC_IPC_CACHE_BYTES", "64GiB"),
    ("USMIPC_IPC_CACHE_BYTES", "1073741824"), ("USMIPC_IPC_CACHE_SIZE", "64"),
    ("USMIPC_IPC_TIMEOUT_MS", "2500"), ("USMIPC_BROKER_THREADS", "2")])
def test_good_values_are_taken_silently(name, value):
    rc, out, err = _run(**{name: value})
    assert rc == 0 and out.strip() == "ok", err
    assert "warning" not in err, err


@pytest.mark.parametrize("name,value,says", [
    ("USMIPC_IPC_CACHE_BYTES", "64X", "a size from 0"),
    ("USMIPC_IPC_CACHE_SIZE", "64G", "a whole number"),
    ("USMIPC_IPC_CACHE_SIZE", "-1", "a whole number"),
    ("USMIPC_BROKER_THREADS", "99", "from 1 to 16"),  # clamped silently before
])
def test_bad_values_warn_and_the_program_runs(name, value, says):
    rc, out, err = _run(**{name: value})
    assert rc == 0 and out.strip() == "ok", err
    assert f"{name}='{value}'" in err and says in err and "using" in err, err
