"""Shared helpers for the usmipc Python tests.

Cross-process tests start helper processes with subprocess (never fork):
``sys.executable -c SOURCE``. Every helper has a timeout so that a hang fails
the test instead of the suite.
"""

import ctypes.util
import multiprocessing
import os
import re
import select
import subprocess
import sys
import textwrap

import pytest

import usmipc

# Which usmipc the tests run against: the one the interpreter imports, an
# installed package (make python installs the tree into .venv; make
# test-wheel installs the release wheel into fresh environments). With
# USMIPC_TEST_INSTALLED=1 (tests/install/wheel.sh) a usmipc imported from
# anywhere but this interpreter's site-packages stops the run.
PACKAGE = os.path.dirname(os.path.abspath(usmipc.__file__))
if os.environ.get("USMIPC_TEST_INSTALLED") == "1":
    import sysconfig
    site = {os.path.realpath(sysconfig.get_paths()[k])
            for k in ("purelib", "platlib")}
    if os.path.dirname(os.path.realpath(PACKAGE)) not in site:
        raise pytest.UsageError(
            f"usmipc was imported from {PACKAGE}, not from this "
            f"interpreter's site-packages ({', '.join(sorted(site))}): "
            "run pytest from a directory without a usmipc package, with "
            "PYTHONPATH unset")


def pytest_report_header(config):
    return f"usmipc {usmipc.__version__} from {PACKAGE}"


# ---- the behaviour probe (tools/probe/README.md) -----------------------------
# With USMIPC_TEST_PROBE=FILE, every exception that pytest.raises catches (and
# every warning that pytest.warns records) is appended to FILE as one line,
# as the C suite's checked failures are (tests/c/probe.h):
#
#   py TAB pid TAB context TAB test TAB file:line TAB what TAB class TAB str(exc)
#
# class is the exception's qualified class name, then its usmipc code name
# (e.name) where it has one; context the device the run defaults to
# (USMIPC_DEFAULT_DEVICE, "-" when unset). Unset, pytest.raises and
# pytest.warns are pytest's own, untouched.
PROBE_FILE = os.environ.get("USMIPC_TEST_PROBE") or None


def _probe_field(value):
    return (str(value).replace("\\", "\\\\").replace("\t", "\\t")
            .replace("\n", "\\n").replace("\r", "\\r"))


def _probe_where(depth):
    """file:line of the frame depth levels above the caller."""
    frame = sys._getframe(depth + 1)
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _probe_write(where, what, code, message):
    test = os.environ.get("PYTEST_CURRENT_TEST", "-").rsplit(" (", 1)[0]
    context = os.environ.get("USMIPC_DEFAULT_DEVICE", "-")
    fields = ["py", os.getpid(), context, test, where, what, code, message]
    line = "\t".join(_probe_field(f) for f in fields) + "\n"
    # One write(2) to an O_APPEND descriptor: the records of processes that
    # write at once do not interleave.
    fd = os.open(PROBE_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode("utf-8", "backslashreplace"))
    finally:
        os.close(fd)


def _probe_code(exc):
    cls = type(exc)
    code = f"{cls.__module__}.{cls.__qualname__}"
    name = getattr(exc, "name", None)
    if isinstance(name, str) and name.startswith("USMIPC_"):
        code += " " + name
    return code


def probe_exception(exc, what):
    """Records an exception a test checks without pytest.raises (one that a
    helper process reports, say); nothing when the probe is off."""
    if PROBE_FILE is not None:
        _probe_write(_probe_where(1), what, _probe_code(exc), str(exc))


# Python messages name Python calls (issue 25): an exception a test
# catches with pytest.raises must not name a C function of the library
# (usmipc_ipc_open, ...); the extension rewrites the library's C words
# (python/usmipc/_ext/util.c, PYTHON_WORDS). Always on.
C_NAME = re.compile(r"\busmipc_[a-z][a-z0-9_]*")


def _check_python_words(exc):
    __tracebackhide__ = True
    found = C_NAME.search(str(exc))
    if found:
        pytest.fail(f"the {type(exc).__name__} caught names the C function "
                    f"{found.group()} (Python messages name Python calls: "
                    f"add its Python words to PYTHON_WORDS in "
                    f"python/usmipc/_ext/util.c): {exc}")


class _ProbeRaises:
    """pytest.raises's context manager, unchanged, that records what it
    caught as the block ends (and checks its words)."""

    def __init__(self, inner, where, what):
        self._inner = inner
        self._where = where
        self._what = what

    def __enter__(self):
        return self._inner.__enter__()

    def __exit__(self, exc_type, exc, tb):
        __tracebackhide__ = True
        caught = self._inner.__exit__(exc_type, exc, tb)
        if caught:
            _check_python_words(exc)
            if PROBE_FILE is not None:
                _probe_write(self._where, self._what, _probe_code(exc),
                             str(exc))
        return caught

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _ProbeWarns:
    """pytest.warns's context manager, unchanged, that records the warnings
    it saw as the block ends."""

    def __init__(self, inner, where):
        self._inner = inner
        self._where = where

    def __enter__(self):
        return self._inner.__enter__()

    def __exit__(self, exc_type, exc, tb):
        __tracebackhide__ = True
        try:
            return self._inner.__exit__(exc_type, exc, tb)
        finally:
            for w in list(self._inner):
                _probe_write(self._where, "pytest.warns",
                             _probe_code(w.message), str(w.message))

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _probe_expected(args, kwargs):
    expected = args[0] if args else kwargs.get("expected_exception")
    if expected is None:
        return "pytest.raises()"
    if not isinstance(expected, tuple):
        expected = (expected,)
    return "pytest.raises(" + ", ".join(
        getattr(e, "__qualname__", repr(e)) for e in expected) + ")"


def _probe_install():
    raises, warns = pytest.raises, pytest.warns

    def probe_raises(*args, **kwargs):
        __tracebackhide__ = True
        where, what = _probe_where(1), _probe_expected(args, kwargs)
        got = raises(*args, **kwargs)
        if isinstance(got, pytest.ExceptionInfo):  # the callable form
            _check_python_words(got.value)
            if PROBE_FILE is not None:
                _probe_write(where, what, _probe_code(got.value),
                             str(got.value))
            return got
        return _ProbeRaises(got, where, what)

    def probe_warns(*args, **kwargs):
        __tracebackhide__ = True
        where = _probe_where(1)
        got = warns(*args, **kwargs)
        if len(args) > 1 or "func" in kwargs or PROBE_FILE is None:
            return got  # the callable form's result; unprobed, as it is
        return _ProbeWarns(got, where)

    probe_raises.__doc__ = raises.__doc__
    probe_warns.__doc__ = warns.__doc__
    pytest.raises, pytest.warns = probe_raises, probe_warns


_probe_install()  # records only with the probe on; checks words always


HOST = "host:cpu"
TIMEOUT = 60  # seconds for any helper process


@pytest.fixture
def leftovers_aside():
    """What usmipc.memory keeps for other tests' receivers, moved aside for
    this test and put back after it: a test of the reaper's own life (that
    it ends once nothing is kept, that what it keeps is dropped) sees only
    its own handles. Earlier tests leave handles kept until this process
    exits, by design: a message pickled by ForkingPickler.dumps and never
    loaded keeps its memory (tests/python/test_torch_reducers.py leaves
    such), and they failed the tests of this fixture when run before them
    in one pytest."""
    from usmipc import memory
    with memory._kept_lock:
        saved = [h for hs in memory._kept.values() for h in hs]
        saved += [h for h in memory._due if not any(h is x for x in saved)]
        memory._kept.clear()
        memory._due.clear()
    try:
        yield
    finally:
        for h in saved:  # through _keep: a reaper runs for them again
            memory._keep(h)


class KeptSince:
    """What usmipc.memory keeps for its receivers (handles and bundles
    whose tickets are out) that was not kept when this was made: other
    tests' leftovers are not this test's."""

    def __init__(self):
        from usmipc import memory
        self._memory = memory
        self._before = {id(h) for h in memory._kept_handles()}

    def __call__(self) -> list:
        return [h for h in self._memory._kept_handles()
                if id(h) not in self._before]

    def after_waiting(self, seconds: float = 5) -> list:
        """What is still kept once nothing is, or after seconds."""
        import time
        deadline = time.monotonic() + seconds
        while self() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self()
MAGIC = b"\x89USMIPC\n"

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
# The Level Zero test driver (tests/level_zero), as make build leaves it.
ZE_TEST_DRIVER = os.environ.get(
    "USMIPC_ZE_TEST_DRIVER", os.path.join(
        ROOT, "build", "tests", "level_zero", "libze_usmipc_test_driver.so"))

# A test file's own tests again, on level_zero:gpu through the test driver,
# in a subprocess that must pass with no skip: the file's test named
# test_the_same_on_level_zero_with_no_skip calls rerun_on_level_zero.
skip_unless_level_zero_rerun = pytest.mark.skipif(
    ctypes.util.find_library("ze_loader") is None or
    not os.path.exists(ZE_TEST_DRIVER) or
    os.environ.get("USMIPC_DEFAULT_DEVICE") is not None,
    reason="no Level Zero loader or test driver (or nested)")


def rerun_on_level_zero(test_file):
    env = dict(os.environ, ZE_ENABLE_ALT_DRIVERS=ZE_TEST_DRIVER,
               USMIPC_DEFAULT_DEVICE="level_zero:gpu")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs",
                        "-p", "no:cacheprovider", "-k",
                        "not the_same_on_level_zero", test_file],
                       capture_output=True, text=True, timeout=300, env=env,
                       cwd=os.path.dirname(os.path.abspath(test_file)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "skipped" not in r.stdout.splitlines()[-1], r.stdout


# A period of 251 (prime) bytes, so that an offset error cannot go unseen;
# the same function is pasted into helper processes (PATTERN_SRC).
PATTERN_SRC = """
def pattern(nbytes, salt):
    block = bytes(((i * 7) + salt) & 0xFF for i in range(251))
    return (block * (nbytes // 251 + 1))[:nbytes]
"""
exec(PATTERN_SRC)  # defines pattern() here too


def child_env(**extra):
    """The environment for a helper process, with extra variables set."""
    env = dict(os.environ)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_python(source, *, input=None, env=None, timeout=TIMEOUT, args=()):
    """Runs Python source in a new interpreter; returns CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source), *args],
        input=input, capture_output=True, env=env, timeout=timeout)


def spawn_peer(target, *args):
    """Runs target(conn, *args) in a process started with spawn (never
    fork); returns the parent's end of a pipe and the process."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args))
    proc.start()
    child.close()
    return parent, proc


def recv_from(conn, proc):
    """The spawned process's next message; a dead or hung one fails the
    test."""
    if not conn.poll(TIMEOUT):
        proc.kill()
        pytest.fail("the spawned process did not answer")
    try:
        return conn.recv()
    except EOFError:
        proc.join(TIMEOUT)
        pytest.fail(f"the spawned process died (exit {proc.exitcode})")


def join_ok(proc):
    """Waits for the spawned process, which must exit with 0."""
    proc.join(TIMEOUT)
    if proc.is_alive():
        proc.kill()
        pytest.fail("the spawned process did not exit")
    assert proc.exitcode == 0


def crc32c(data, crc=0):
    """CRC32C (Castagnoli), reflected, as in docs/handle-format.md."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def reseal(handle_bytes):
    """Recomputes the trailing checksum of edited handle bytes."""
    body = bytes(handle_bytes[:-4])
    return body + crc32c(body).to_bytes(4, "little")


EXPORTER_SRC = PATTERN_SRC + """
import sys
import usmipc
from usmipc.memory import IPCMemoryHandle, MemoryUSMDevice

nbytes = int(sys.argv[1])
mem = MemoryUSMDevice(nbytes, device="host:cpu")
mem.copy_from_host(pattern(nbytes, 1))
handle = IPCMemoryHandle(mem)
print(handle.to_bytes().hex(), flush=True)
# One command per line: "dump" prints the memory as hex; EOF ends.
for line in sys.stdin:
    if line.strip() == "dump":
        print(mem.tobytes().hex(), flush=True)
"""


class Exporter:
    """A helper process that exports nbytes of device memory (pattern salt
    1) and keeps it until its stdin closes."""

    def __init__(self, nbytes=1 << 16):
        self.nbytes = nbytes
        self.proc = subprocess.Popen(
            [sys.executable, "-c", EXPORTER_SRC, str(nbytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self._readline()
        if not line:
            self.close()
            raise RuntimeError("the exporter process died before exporting")
        self.raw = bytes.fromhex(line.strip())

    def _readline(self):
        # a hung helper fails the test instead of hanging the suite
        ready, _, _ = select.select([self.proc.stdout], [], [], TIMEOUT)
        if not ready:
            self.proc.kill()
            raise TimeoutError("the exporter process did not answer")
        return self.proc.stdout.readline()

    def dump(self):
        """The exported memory as the exporter reads it."""
        self.proc.stdin.write("dump\n")
        self.proc.stdin.flush()
        return bytes.fromhex(self._readline().strip())

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=TIMEOUT)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=TIMEOUT)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


@pytest.fixture
def host():
    return usmipc.Device(HOST)


@pytest.fixture
def exporter():
    exp = Exporter()
    try:
        yield exp
    finally:
        exp.close()


@pytest.fixture
def no_ipc_cache():
    """Closed mappings are unmapped at once (no re-open cache), so that a
    test can observe the unmap."""
    usmipc.set_ipc_cache_size(0)
    try:
        yield
    finally:
        usmipc.set_ipc_cache_size(64)


def is_known(address):
    """True while usmipc knows the address (allocation or open mapping)."""
    try:
        usmipc._usmipc._pointer_query(address)
    except usmipc.Error as e:
        probe_exception(e, "is_known: _pointer_query")
        assert e.name == "USMIPC_EUNKNOWNPTR", e
        return False
    return True
