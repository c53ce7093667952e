"""Fail-first reproducers for the transport-trust work: fork safety of the
core's locks, Ctrl-C and a deadline for an open that waits on a stalled
exporter, the idle cache bounded in bytes.

GPU-free: everything runs on the host device (memfd memory). Whatever may
hang (a deadlock, a wait that never ends) runs in a helper process under
subprocess timeouts, so that a hang fails its test instead of the suite.
"""

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

import usmipc

from conftest import PATTERN_SRC, Exporter, child_env, run_python

STORM_TIMEOUT = 120  # seconds for a whole fork-storm helper
SIGNAL_LATENCY = 0.1  # seconds from SIGINT to KeyboardInterrupt


def _failure(result, what):
    """A readable assertion message from a finished helper."""
    return (f"{what}: exit {result.returncode}\n"
            f"--- stdout (tail) ---\n{result.stdout.decode()[-3000:]}\n"
            f"--- stderr (tail) ---\n{result.stderr.decode()[-6000:]}")


def _run_storm(source, *args, timeout=STORM_TIMEOUT):
    """Runs a helper that must finish within timeout; a hang fails the test
    with the helper's output so far."""
    try:
        return run_python(source, args=[str(a) for a in args], timeout=timeout,
                          env=child_env(PYTHONFAULTHANDLER=1))
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode()[-3000:]
        err = (e.stderr or b"").decode()[-6000:]
    pytest.fail(f"the helper did not finish within {timeout} s "
                f"(deadlocked?)\n--- stdout (tail) ---\n{out}\n"
                f"--- stderr (tail) ---\n{err}")


# ---- the bindings -----------------------------------------------------------


def test_bindings_are_exported():
    for name in ("set_ipc_timeout", "set_ipc_cache_bytes",
                 "set_ipc_cache_size", "IPCTimeoutError"):
        assert name in usmipc.__all__, name
        assert callable(getattr(usmipc, name)), name
    assert issubclass(usmipc.IPCTimeoutError, usmipc.Error)
    assert issubclass(usmipc.IPCTimeoutError, TimeoutError)
    for name, value in [("USMIPC_ETIMEDOUT", -110), ("USMIPC_EINTR", -4),
                        ("USMIPC_EMFILE", -24), ("USMIPC_ENAMESPACE", -30012),
                        ("USMIPC_EUNTRUSTED", -30013)]:
        assert getattr(usmipc, name) == value
        assert usmipc.errorcode[value] == name


def test_set_ipc_timeout_arguments():
    try:
        for seconds in (0.5, 1, 30.0, 1e-4, 4294967.295, 0):
            assert usmipc.set_ipc_timeout(seconds) is None
        for bad in (-1, -0.001, float("nan"), float("inf"), 1e10):
            with pytest.raises(ValueError):
                usmipc.set_ipc_timeout(bad)
        with pytest.raises(TypeError):
            usmipc.set_ipc_timeout("5")
        with pytest.raises(TypeError):
            usmipc.set_ipc_timeout(None)
    finally:
        usmipc.set_ipc_timeout(0)


def test_set_ipc_cache_bytes_arguments():
    try:
        for nbytes in (0, 1, 1 << 27, 1 << 40):
            assert usmipc.set_ipc_cache_bytes(nbytes) is None
        with pytest.raises(ValueError):
            usmipc.set_ipc_cache_bytes(-1)
        with pytest.raises(TypeError):
            usmipc.set_ipc_cache_bytes(1.5)
        with pytest.raises(OverflowError):
            usmipc.set_ipc_cache_bytes(1 << 70)
    finally:
        usmipc.set_ipc_cache_bytes(1 << 30)


# ---- fork safety ------------------------------------------------------------

# A thread churns allocations and exports (every lock of the core's export
# path) while the main thread forks; each child allocates, exports and
# opens a handle the parent exported before the storm. faulthandler dumps
# every thread's Python stack if the parent wedges (os.fork holds the GIL,
# so only its C watchdog can) or a child does (SIGABRT before SIGKILL).
FORK_STORM_SRC = PATTERN_SRC + r"""
import faulthandler, json, os, signal, sys, threading, time, traceback
import usmipc
from usmipc.memory import IPCMemoryHandle, MemoryUSMDevice

FORKS = int(sys.argv[1])
CHILD_DEADLINE = 10.0
faulthandler.enable()
dev = usmipc.Device("host:cpu")
mem = MemoryUSMDevice(4096, device=dev)
expected = pattern(4096, 5)
mem.copy_from_host(expected)
handle = IPCMemoryHandle(mem)
raw = handle.to_bytes()

stop = threading.Event()
churned = 0
def churn():
    global churned
    while not stop.is_set():
        m = MemoryUSMDevice(4096, device=dev)
        h = IPCMemoryHandle(m)
        h.to_bytes()
        del h, m
        churned += 1
threading.Thread(target=churn, daemon=True).start()
while churned < 10:
    time.sleep(0.001)

def child():
    try:
        m = MemoryUSMDevice(4096, device=dev)
        IPCMemoryHandle(m).to_bytes()
        got = IPCMemoryHandle.open(raw, dev)
        ok = got.tobytes() == expected
        IPCMemoryHandle.close_mapping(got)
        code = 0 if ok else 3
        if not ok:
            print("child: the parent's bytes did not read back",
                  file=sys.stderr)
    except BaseException as e:
        print(f"child: {type(e).__name__}: {e}", file=sys.stderr)
        code = 4
    sys.stderr.flush()
    os._exit(code)

failed, hung, done = [], [], 0
t0 = time.monotonic()
for i in range(FORKS):
    # the parent wedged in fork (its atfork handlers): dump stacks, exit 1
    faulthandler.dump_traceback_later(20, exit=True)
    if i % 250 == 0:
        print(f"fork {i}", flush=True)
    pid = os.fork()
    if pid == 0:
        child()
    deadline = time.monotonic() + CHILD_DEADLINE
    while True:
        r, status = os.waitpid(pid, os.WNOHANG)
        if r:
            break
        if time.monotonic() > deadline:
            print(f"child {i} (pid {pid}) hung for {CHILD_DEADLINE} s; its "
                  f"Python stack follows on stderr", flush=True)
            os.kill(pid, signal.SIGABRT)  # faulthandler in the child
            time.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            hung.append(i)
            break
        time.sleep(0.0005)
    if hung:
        break
    done += 1
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        failed.append((i, code))
        if len(failed) >= 20:
            break
faulthandler.cancel_dump_traceback_later()
stop.set()
print(json.dumps({"forks": done, "failed": failed, "hung": hung,
                  "churned": churned,
                  "seconds": round(time.monotonic() - t0, 1)}), flush=True)
os._exit(0 if not failed and not hung and done == FORKS else 1)
"""


def test_fork_storm_python():
    """2000 os.fork() while another thread allocates and exports: no
    deadlock in the parent or a child, and every child can export and open
    the parent's memory."""
    result = _run_storm(FORK_STORM_SRC, 2000)
    assert result.returncode == 0, _failure(result, "fork storm")
    summary = json.loads(result.stdout.decode().splitlines()[-1])
    assert summary["forks"] == 2000 and not summary["failed"], summary


MP_FORK_SRC = PATTERN_SRC + r"""
import faulthandler, multiprocessing, os, sys, threading, time
import usmipc
from usmipc.memory import IPCMemoryHandle, MemoryUSMDevice

faulthandler.enable()
faulthandler.dump_traceback_later(40, exit=True)  # a good run takes < 1 s
dev = usmipc.Device("host:cpu")
mem = MemoryUSMDevice(4096, device=dev)
EXPECTED = pattern(4096, 6)
mem.copy_from_host(EXPECTED)
handle = IPCMemoryHandle(mem)
RAW = handle.to_bytes()

def work(i):
    m = MemoryUSMDevice(4096, device=dev)
    IPCMemoryHandle(m).to_bytes()
    got = IPCMemoryHandle.open(RAW, dev)
    data = got.tobytes()
    IPCMemoryHandle.close_mapping(got)
    return i, data

def process_main(i, conn):
    try:
        conn.send(work(i))
    except BaseException as e:
        conn.send((i, f"{type(e).__name__}: {e}"))
    conn.close()

stop = threading.Event()
def churn():
    while not stop.is_set():
        m = MemoryUSMDevice(4096, device=dev)
        h = IPCMemoryHandle(m)
        h.to_bytes()
        del h, m
# Three churning threads: with one, 50 forks meet the window only in about
# two runs of three on the seed's core; with three, every time.
for _ in range(3):
    threading.Thread(target=churn, daemon=True).start()

ctx = multiprocessing.get_context("fork")
results = {}
# 25 Pool workers, one task each: the pool's own thread forks them
with ctx.Pool(4, maxtasksperchild=1) as pool:
    for i, data in pool.map_async(work, range(25)).get(timeout=30):
        results[i] = data
print("pool done", flush=True)
# 25 Process children, five at a time
for batch in range(25, 50, 5):
    procs = []
    for i in range(batch, batch + 5):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=process_main, args=(i, child))
        p.start()
        child.close()
        procs.append((i, p, parent))
    for i, p, parent in procs:
        if not parent.poll(30):
            print(f"process child {i} gave no answer in 30 s", flush=True)
            os._exit(1)
        j, data = parent.recv()
        results[j] = data
        p.join(10)
stop.set()
bad = {i: d for i, d in results.items() if d != EXPECTED}
print("results", len(results), "bad", {i: (d if isinstance(d, str) else
      "wrong bytes") for i, d in bad.items()}, flush=True)
os._exit(0 if len(results) == 50 and not bad else 1)
"""


def test_multiprocessing_fork_children():
    """50 children of multiprocessing's fork context (Pool workers forked
    by the pool's thread, and Process objects), started while threads
    export fresh buffers: each exports and reads the parent's memory."""
    result = _run_storm(MP_FORK_SRC)
    assert result.returncode == 0, _failure(result, "multiprocessing children")
    assert "results 50 bad {}" in result.stdout.decode()


# ---- an exporter that stopped answering -------------------------------------


@pytest.fixture
def stalled_exporter():
    """An exporter (a helper process) that is SIGSTOPped after exporting:
    its fd broker accepts connections (the kernel does) but never answers."""
    exp = Exporter(1 << 16)
    os.kill(exp.proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{exp.proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                break
        time.sleep(0.01)
    else:
        pytest.fail("the exporter did not stop")
    try:
        yield exp
    finally:
        os.kill(exp.proc.pid, signal.SIGCONT)
        exp.kill()
        exp.close()


# Opens the handle (argv[1], hex) with the timeout argv[2] in seconds and
# says how it ended, one line: "OPENED", "ERROR <name> <code> <seconds>
# <is TimeoutError>", or "KeyboardInterrupt <monotonic now> <seconds in
# open>". A KeyboardInterrupt that only surfaces after the open gave up is
# reported the same way (its time shows it was late). With argv[3] ==
# "alarm", SIGALRM arrives every 50 ms and a Python handler counts it.
STALLED_IMPORTER_SRC = r"""
import signal, sys, time
# Ctrl-C must reach this child as KeyboardInterrupt even where the test
# runner was started with SIGINT ignored (a background job of a shell
# without job control: Python then installs no handler of its own).
signal.signal(signal.SIGINT, signal.default_int_handler)
import usmipc
from usmipc.memory import IPCMemoryHandle

dev = usmipc.Device("host:cpu")
usmipc.set_ipc_timeout(float(sys.argv[2]))
raw = bytes.fromhex(sys.argv[1])
IPCMemoryHandle.inspect(raw)
alarms = 0
if sys.argv[3] == "alarm":
    def on_alarm(signum, frame):
        global alarms
        alarms += 1
    signal.signal(signal.SIGALRM, on_alarm)
print("opening", flush=True)
t0 = time.monotonic()
try:
    if sys.argv[3] == "alarm":
        signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
    try:
        m = IPCMemoryHandle.open(raw, dev)
        print("OPENED", repr(time.monotonic() - t0), flush=True)
    except usmipc.Error as e:
        t = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0)
        print("ERROR", e.name, e.code, repr(t - t0),
              isinstance(e, TimeoutError), alarms, flush=True)
        print(e, file=sys.stderr, flush=True)
    time.sleep(1)  # a late KeyboardInterrupt surfaces here
except KeyboardInterrupt:
    t = time.monotonic()
    print("KeyboardInterrupt", repr(t), repr(t - t0), flush=True)
"""


def _start_importer(raw, timeout_s, mode=""):
    proc = subprocess.Popen(
        [sys.executable, "-c", STALLED_IMPORTER_SRC, raw.hex(), str(timeout_s),
         mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=child_env(USMIPC_FD_TRANSPORT="socket"))
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if ready else b""
    if line.strip() != b"opening":
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the importer did not start: {line!r} {out!r} "
                    f"{err.decode()[-2000:]}")
    return proc


def _finish(proc, timeout):
    try:
        out, err = proc.communicate(timeout=timeout)
        return out.decode(), err.decode()
    except subprocess.TimeoutExpired:
        proc.kill()
    out, err = proc.communicate()
    pytest.fail(f"the importer was still waiting after {timeout} s: "
                f"{out.decode()!r} {err.decode()[-2000:]}")


def test_ctrl_c_interrupts_stalled_open(stalled_exporter):
    """Ctrl-C during an open waiting on a stopped exporter raises
    KeyboardInterrupt at once, not when the wait gives up (timeout 30 s)."""
    proc = _start_importer(stalled_exporter.raw, 30)
    time.sleep(0.3)
    t_signal = time.monotonic()  # CLOCK_MONOTONIC, as in the importer
    os.kill(proc.pid, signal.SIGINT)
    out, err = _finish(proc, 40)
    words = out.split()
    assert words and words[0] == "KeyboardInterrupt", (out, err)
    t_raised, in_open = float(words[1]), float(words[2])
    assert in_open >= 0.25, f"interrupted before the open started: {out}"
    latency = t_raised - t_signal
    assert latency < SIGNAL_LATENCY, \
        f"KeyboardInterrupt came {latency:.3f} s after SIGINT ({out!r}, {err})"


def test_timeout_setting(stalled_exporter):
    """set_ipc_timeout(0.5): the open gives up after about 0.5 s with
    USMIPC_ETIMEDOUT (usmipc.IPCTimeoutError)."""
    proc = _start_importer(stalled_exporter.raw, 0.5)
    out, err = _finish(proc, 30)
    words = out.split()
    assert words and words[0] == "ERROR", (out, err)
    name, code, elapsed = words[1], int(words[2]), float(words[3])
    assert (name, code) == ("USMIPC_ETIMEDOUT", usmipc.USMIPC_ETIMEDOUT), \
        (out, err)
    assert 0.4 <= elapsed <= 1.5, f"gave up after {elapsed:.3f} s: {err}"
    assert words[4] == "True", "usmipc.IPCTimeoutError is a TimeoutError"


def test_periodic_signals_do_not_extend_the_deadline(stalled_exporter):
    """A signal every 50 ms (with a Python handler that returns normally)
    neither ends the open nor restarts its wait: it still gives up at its
    one deadline, and the handler runs meanwhile."""
    proc = _start_importer(stalled_exporter.raw, 1.0, "alarm")
    out, err = _finish(proc, 20)
    words = out.split()
    assert words and words[0] == "ERROR", (out, err)
    name, elapsed, alarms = words[1], float(words[3]), int(words[5])
    assert name == "USMIPC_ETIMEDOUT", (out, err)
    assert 0.9 <= elapsed <= 2.0, f"gave up after {elapsed:.3f} s: {err}"
    assert alarms >= 5, f"the SIGALRM handler ran {alarms} times in the open"


# ---- the idle cache in bytes ------------------------------------------------

MANY_EXPORTER_SRC = r"""
import sys
from usmipc.memory import IPCMemoryHandle, MemoryUSMDevice
mems = [MemoryUSMDevice(int(sys.argv[2]), device="host:cpu")
        for _ in range(int(sys.argv[1]))]
for i, m in enumerate(mems):
    m.copy_from_host(bytes([i + 1]) * 16)
handles = [IPCMemoryHandle(m) for m in mems]
print(" ".join(h.to_bytes().hex() for h in handles), flush=True)
sys.stdin.read()
"""

CACHE_IMPORTER_SRC = r"""
import json, re, sys
import usmipc
from usmipc.memory import IPCMemoryHandle

def memfd_mappings():
    # usmipc's allocations ("/memfd:usmipc (deleted)"), not its export
    # tables ("/memfd:usmipc-exports.<pid>.<nonce>")
    pattern = re.compile(r"/memfd:usmipc( \(deleted\))?$")
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if pattern.search(line.rstrip()))

raws = [bytes.fromhex(h) for h in sys.stdin.readline().split()]
dev = usmipc.Device("host:cpu")
usmipc.set_ipc_cache_bytes(128 << 20)
counts = []
for i, raw in enumerate(raws):
    m = IPCMemoryHandle.open(raw, dev)
    assert m.tobytes()[:16] == bytes([i + 1]) * 16, i
    open_count = memfd_mappings()
    IPCMemoryHandle.close_mapping(m)
    counts.append((open_count, memfd_mappings()))
usmipc.set_ipc_cache_bytes(0)
print(json.dumps({"counts": counts, "after_zero": memfd_mappings()}))
"""


def test_idle_cache_bytes():
    """set_ipc_cache_bytes(128 MiB): of eight closed 64 MiB mappings (512
    MiB, under the entry bound of 64) at most two stay mapped; 0 unmaps
    them all."""
    nbufs, size = 8, 64 << 20
    exporter = subprocess.Popen(
        [sys.executable, "-c", MANY_EXPORTER_SRC, str(nbufs), str(size)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        ready, _, _ = select.select([exporter.stdout], [], [], 60)
        assert ready, "the exporter did not answer"
        line = exporter.stdout.readline()
        assert len(line.split()) == nbufs, line[:200]
        result = run_python(CACHE_IMPORTER_SRC, input=line)
        assert result.returncode == 0, _failure(result, "importer")
        summary = json.loads(result.stdout.decode())
        for i, (while_open, after_close) in enumerate(summary["counts"]):
            assert while_open <= 2 + 1, (i, summary)
            assert after_close <= 2, (i, summary)
        assert summary["after_zero"] == 0, summary
    finally:
        exporter.stdin.close()
        try:
            exporter.wait(timeout=30)
        except subprocess.TimeoutExpired:
            exporter.kill()
            exporter.wait()
