"""The seed's example and the demo on level_zero:gpu, through Debian's Level
Zero loader and the project's test driver (tests/level_zero), which `make
test` builds into build/ before it runs these tests. What this verifies: the
backend against the loader's real ABI and usmipc's IPC protocol; not an
Intel driver or GPU (docs/level-zero.md)."""
import ctypes.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DRIVER = pathlib.Path(os.environ.get(
    "USMIPC_ZE_TEST_DRIVER",
    ROOT / "build" / "tests" / "level_zero" / "libze_usmipc_test_driver.so"))

pytestmark = [
    pytest.mark.skipif(ctypes.util.find_library("ze_loader") is None,
                       reason="no Level Zero loader (apt-get install libze1)"),
    pytest.mark.skipif(not DRIVER.exists(),
                       reason=f"test driver not built at {DRIVER} (make build)"),
]


def run(*args, **env):
    environment = dict(os.environ, ZE_ENABLE_ALT_DRIVERS=str(DRIVER), **env)
    return subprocess.run([sys.executable, *args], capture_output=True,
                          timeout=120, env=environment, cwd=ROOT)


def test_seed_example_on_level_zero():
    result = run(str(ROOT / "examples" / "seed_example.py"), "level_zero:gpu")
    assert result.returncode == 0, result.stderr.decode()
    lines = result.stdout.decode().splitlines()
    assert lines[0].startswith("IPC handle: ") and lines[0].endswith(" bytes")
    assert lines[1] == "Opened: 4096 bytes on usmipc Level Zero test device"
    assert lines[2] == "close OK"


@pytest.mark.parametrize("transport", ["socket", "auto"])
def test_demo_on_level_zero(transport):
    result = run("-m", "usmipc", "demo", "--device", "level_zero:gpu",
                 USMIPC_FD_TRANSPORT=transport)
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "demo OK" in out
    assert "level_zero:gpu:0" in out


def test_bundle_on_level_zero():
    result = run(str(ROOT / "examples" / "share_state_dict.py"),
                 "level_zero:gpu")
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "bundle OK" in out and "3 arrays in 1 allocation" in out


def test_handle_sizes_on_level_zero():
    # docs/handle-format.md: a Level Zero handle is 236 bytes (the fixed 216
    # and record 0x0201 of 4 + 16), ordering adds 104 (record 0x8002 of
    # 4 + 68 + a 32-byte event pool payload), an event handle is 268.
    result = run("-c", """if True:
        import usmipc
        from usmipc.memory import IPCMemoryHandle, MemoryUSMDevice
        d = usmipc.Device("level_zero:gpu")
        mem = MemoryUSMDevice(4096, device=d)
        ev = usmipc.Event(d)
        ev.record()
        print(len(IPCMemoryHandle(mem, ordered=False).to_bytes()),
              len(IPCMemoryHandle(mem).to_bytes()),
              len(usmipc.IPCEventHandle(ev).to_bytes()))
        """)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().split() == ["236", "340", "268"]


def test_selftest_runs_the_helper_beside_the_extension(tmp_path):
    """The self-test on first IPC use (forced on the test driver) starts the
    usmipc-helper that the package carries beside its extension (the wheel's
    own executable, when tests/install/wheel.sh runs this); the verdict it
    leaves says the helper exported memory that this process read back."""
    import usmipc
    helper = pathlib.Path(usmipc._usmipc.__file__).with_name("usmipc-helper")
    assert os.access(helper, os.X_OK), f"{helper} is missing"
    result = run("-c", "import usmipc; "
                 "print(usmipc.Device('level_zero:gpu').has_aspect_ipc_memory)",
                 USMIPC_ZE_SELFTEST="1", XDG_RUNTIME_DIR=str(tmp_path),
                 USMIPC_HELPER="")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().strip() == "True", result.stderr.decode()
    verdicts = list(tmp_path.glob("usmipc-ze-selftest-*"))
    assert len(verdicts) == 1 and verdicts[0].read_text() == "ok\n", verdicts
