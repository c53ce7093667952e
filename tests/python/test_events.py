"""Events and ordered handoffs from Python: usmipc.Event, IPCEventHandle
(pickled into processes started with multiprocessing's spawn), ordered
IPCMemoryHandle bytes, Queue.from_stream and the stream= arguments, and
every way event bytes can be wrong.

On the host backend a queue's work completes when submitted, so an event is
complete when recorded: what these tests prove is the protocol (bytes,
records, opens, caches, errors), the bindings' arguments and lifetimes, not
a device wait (tests/gpu does those on CUDA).
"""

import ctypes.util
import gc
import os
import pathlib
import pickle
import select
import signal
import subprocess
import sys
import time
import types

import pytest

import usmipc
from usmipc import Event, IPCEventHandle, Queue
from usmipc.memory import IPCMemoryHandle, MemoryUSMDevice

from conftest import (TIMEOUT, child_env, join_ok, pattern, probe_exception,
                      recv_from, reseal, run_python, spawn_peer)

SIGNAL_LATENCY = 0.1  # seconds from SIGINT to KeyboardInterrupt


def _fd_count():
    return len(os.listdir("/proc/self/fd"))




# ---- exports -----------------------------------------------------------------


def test_names_are_exported():
    for name in ("Event", "IPCEventHandle", "set_event_timeout"):
        assert name in usmipc.__all__, name
    assert "IPCEventHandle" in usmipc.memory.__all__
    assert usmipc.memory.IPCEventHandle is IPCEventHandle
    assert usmipc.USMIPC_ENOTREADY == -30014
    assert usmipc.errorcode[usmipc.USMIPC_ENOTREADY] == "USMIPC_ENOTREADY"


# ---- Event -------------------------------------------------------------------


def test_event_basics(host):
    for device in (host, "host:cpu", Queue(host)):
        assert Event(device).device is host
    assert Event().device is usmipc.Device()
    e = Event(device=host)
    assert e.is_opened is False
    assert "created here" in repr(e) and "host:cpu:0" in repr(e)
    assert e.query() is True  # never recorded: complete
    e.synchronize()
    q = Queue(host)
    for stream in (None, q, 0, Queue.from_stream(0, device=host)):
        e.record(stream)
        e.record(stream=stream)
        assert e.query() is True  # host work completes when submitted
        e.wait(stream)
        e.wait(stream=q)
        e.synchronize()
    with pytest.raises(TypeError, match="IPCEventHandle"):
        pickle.dumps(e)
    with pytest.raises(TypeError):
        Event(42)
    with pytest.raises(ValueError):
        Event("nonsense:device")


@pytest.mark.parametrize("stream, error, text", [
    (5, ValueError, "only stream it accepts is 0"),
    (-1, ValueError, "non-negative"),
    (True, TypeError, "must be a usmipc.Queue"),
    ("queue", TypeError, "must be a usmipc.Queue"),
    (object(), TypeError, "must be a usmipc.Queue"),
])
def test_event_bad_streams(stream, error, text, host):
    e = Event(host)
    for call in (e.record, e.wait):
        with pytest.raises(error, match=text):
            call(stream)
    assert e.query() is True


def test_set_event_timeout():
    try:
        for seconds in (0.5, 1, 1e-9, 3600.0, 0, None):
            usmipc.set_event_timeout(seconds)
        for bad in (-1, float("nan")):
            with pytest.raises(ValueError, match="None or >= 0"):
                usmipc.set_event_timeout(bad)
        with pytest.raises(TypeError):
            usmipc.set_event_timeout("1s")
        usmipc.set_event_timeout(0.25)
        e = Event("host:cpu")
        e.record()
        e.synchronize()  # complete: the limit does not matter
    finally:
        usmipc.set_event_timeout(None)


# ---- IPCEventHandle in one process -----------------------------------------------


def test_event_handle_in_one_process(host):
    e = Event(host)
    h0 = IPCEventHandle(e)
    assert h0.event_point == 0  # no record yet: complete at once
    e.record()
    h = IPCEventHandle(event=e)
    raw = h.to_bytes()
    assert isinstance(raw, bytes) and bytes(h) == raw
    assert h.event is e and h.device is host and h.backend == "host"
    assert h.exporter_pid == os.getpid() and h.event_point == 1
    assert h.device_uuid == host.uuid
    assert "record 1" in repr(h)
    info = h.inspect()
    assert info == IPCMemoryHandle.inspect(raw) == IPCMemoryHandle.inspect(h)
    assert info["is_event"] is True and info["is_ordered"] is False
    assert info["event_point"] == 1 and info["length"] == len(raw)
    assert h0.to_bytes() != raw
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        h2 = pickle.loads(pickle.dumps(h, protocol=protocol))
        assert type(h2) is IPCEventHandle and h2 == h and hash(h2) == hash(h)
        assert h2.event is None and h2.to_bytes() == raw
    assert IPCEventHandle.from_bytes(bytearray(raw)) == h

    for source in (raw, h, bytearray(raw), memoryview(raw)):
        view = IPCEventHandle.open(source)
        assert view.is_opened and "opened from a handle" in repr(view)
        assert view.device is host
        view.synchronize()
        view.wait()
        view.wait(Queue(host))
        assert view.query() is True
    assert IPCEventHandle.open(raw, device=host).device is host
    assert IPCEventHandle.open(handle_bytes=raw, device="host:cpu").query()


def test_record_on_an_opened_event_raises(host):
    e = Event(host)
    e.record()
    view = IPCEventHandle.open(IPCEventHandle(e).to_bytes())
    with pytest.raises(ValueError) as info:
        view.record()
    assert info.value.name == "USMIPC_EINVAL"
    assert "cannot be recorded" in str(info.value)
    assert "IPCEventHandle(event)" in str(info.value)
    with pytest.raises(ValueError, match="forward the original handle"):
        IPCEventHandle(view)
    view.synchronize()  # it still waits


def test_event_handle_takes_only_events(host):
    for obj in (MemoryUSMDevice(64, device=host), b"bytes", None, host):
        with pytest.raises(TypeError):
            IPCEventHandle(obj)


def test_destroyed_event_is_refused(host):
    e = Event(host)
    e.record()
    h = IPCEventHandle(e)
    raw = h.to_bytes()
    view = IPCEventHandle.open(raw)
    del h, e
    gc.collect()
    with pytest.raises(usmipc.Error) as info:
        view.synchronize()
    assert info.value.name == "USMIPC_EEXPORTERGONE"
    assert "destroyed" in str(info.value)
    with pytest.raises(usmipc.Error) as info:
        IPCEventHandle.open(raw)
    assert info.value.name == "USMIPC_EEXPORTERGONE"


# ---- IPCEventHandle across processes (spawn) ---------------------------------------


def _event_importer(conn, handle):
    """Opens a pickled IPCEventHandle, waits every way, reports; then, once
    the parent destroyed the event, reports how its waits fail."""
    try:
        assert handle.event is None
        ev = IPCEventHandle.open(handle)
        ev.synchronize()
        ev.wait()
        ev.wait(Queue("host:cpu"))
        ev.wait(0)
        conn.send(("opened", ev.query(), ev.is_opened, ev.device.filter_string,
                   handle.event_point, os.getpid()))
        assert conn.recv() == "destroyed"
        out = []
        for call in (ev.synchronize, lambda: IPCEventHandle.open(handle)):
            try:
                call()
                out.append("no error")
            except usmipc.Error as e:
                probe_exception(e, "peer process: after the exporter's "
                                   "destroy")
                out.append(e.name)
        conn.send(("after", *out))
    except BaseException as e:  # reported to the parent
        conn.send(("error", repr(e)))


def test_event_handle_pickled_into_a_spawned_process(host):
    e = Event(host)
    e.record()
    e.record()
    h = IPCEventHandle(e)
    conn, proc = spawn_peer(_event_importer, h)  # the handle travels by pickle
    try:
        reply = recv_from(conn, proc)
        assert reply[0] == "opened", reply
        assert reply[1:5] == (True, True, "host:cpu:0", 2)
        assert reply[5] != os.getpid()
        del h, e
        gc.collect()  # destroys the event: importers are refused
        conn.send("destroyed")
        reply = recv_from(conn, proc)
        assert reply == ("after", "USMIPC_EEXPORTERGONE",
                         "USMIPC_EEXPORTERGONE"), reply
    finally:
        conn.close()
        join_ok(proc)


def _event_reopener(conn, raw, count):
    """Opens raw count times (keeping every Event), reports the fd counts
    before and after and the time per open."""
    try:
        first = IPCEventHandle.open(raw)  # connects to the exporter once
        first.synchronize()
        gc.collect()
        before = _fd_count()
        events = []
        t0 = time.perf_counter()
        for _ in range(count):
            events.append(IPCEventHandle.open(raw))
        per_open = (time.perf_counter() - t0) / count
        for ev in events[::100]:
            ev.synchronize()
        del events
        gc.collect()
        conn.send(("ok", before, _fd_count(), per_open))
    except BaseException as e:
        conn.send(("error", repr(e)))


def test_reopen_is_cached(host):
    """1000 opens of an event already open are lookups in the import cache:
    no descriptor more, and cheap (the bound is loose for loaded CI)."""
    e = Event(host)
    e.record()
    raw = IPCEventHandle(e).to_bytes()
    conn, proc = spawn_peer(_event_reopener, raw, 1000)
    try:
        reply = recv_from(conn, proc)
        assert reply[0] == "ok", reply
        _, before, after, per_open = reply
        assert after == before, f"fd count grew from {before} to {after}"
        assert per_open < 200e-6, f"{per_open * 1e6:.1f} us per re-open"
    finally:
        conn.close()
        join_ok(proc)


# ---- bad event bytes -------------------------------------------------------------


@pytest.fixture
def event_raw(host):
    e = Event(host)
    e.record()
    h = IPCEventHandle(e)
    yield h.to_bytes()
    del h, e


def _event_open_error(data):
    with pytest.raises(ValueError) as info:
        IPCEventHandle.open(data)
    e = info.value
    assert str(e), "the message says what was wrong"
    assert e.code < 0 and e.name.startswith("USMIPC_E")
    return e


def test_truncated_event_handles(event_raw):
    for n in (0, 1, 8, 12, 100, 216, len(event_raw) - 4, len(event_raw) - 1):
        e = _event_open_error(event_raw[:n])
        assert e.name == "USMIPC_EBADHANDLE", (n, e)
        with pytest.raises(ValueError):
            IPCEventHandle.from_bytes(event_raw[:n])
    e = _event_open_error(event_raw + b"\0")
    assert e.name == "USMIPC_EBADHANDLE"


def test_every_bit_flip_of_an_event_handle_is_refused(event_raw):
    for i in range(len(event_raw)):
        for bit in (0, 7):
            flipped = bytearray(event_raw)
            flipped[i] ^= 1 << bit
            e = _event_open_error(bytes(flipped))
            assert e.name in ("USMIPC_EBADHANDLE",
                              "USMIPC_EHANDLEVERSION"), (i, bit, e)


def test_forged_record_is_refused(event_raw):
    """A resealed handle naming a record the exporter never made."""
    # docs/handle-format.md: payload and extension lengths at 208 and 210;
    # the event record (type 0x8001) starts the extensions, its body with
    # the record's point (u64)
    plen = int.from_bytes(event_raw[208:210], "little")
    at = 212 + plen
    assert int.from_bytes(event_raw[at:at + 2], "little") == 0x8001
    at += 4
    assert int.from_bytes(event_raw[at:at + 8], "little") == 1
    forged = bytearray(event_raw)
    forged[at:at + 8] = (1000).to_bytes(8, "little")
    e = _event_open_error(reseal(forged))
    assert e.name == "USMIPC_EBADHANDLE" and "forged" in str(e)


def test_memory_and_event_handles_are_not_interchangeable(event_raw, host):
    mem = MemoryUSMDevice(4096, device=host)
    mh = IPCMemoryHandle(mem)
    mem_raw = mh.to_bytes()

    e = _event_open_error(mem_raw)
    assert e.name == "USMIPC_EINVAL"
    assert "memory handle" in str(e) and "IPCMemoryHandle.open()" in str(e)
    with pytest.raises(ValueError, match="IPCMemoryHandle.open"):
        IPCEventHandle.from_bytes(mem_raw)
    with pytest.raises(TypeError, match="IPCMemoryHandle"):
        IPCEventHandle.open(mh)

    with pytest.raises(ValueError) as info:
        IPCMemoryHandle.open(event_raw)
    assert info.value.name == "USMIPC_EINVAL"
    assert "event handle" in str(info.value)
    assert "IPCEventHandle.open()" in str(info.value)
    with pytest.raises(ValueError, match="IPCEventHandle.from_bytes"):
        IPCMemoryHandle.from_bytes(event_raw)
    with pytest.raises(TypeError, match="IPCEventHandle"):
        IPCMemoryHandle.open(IPCEventHandle.from_bytes(event_raw))


# ---- Ctrl-C and the deadline while opening from a stalled exporter ---------

EVENT_EXPORTER_SRC = """
import sys, usmipc
e = usmipc.Event("host:cpu")
e.record()
h = usmipc.IPCEventHandle(e)
print(h.to_bytes().hex(), flush=True)
sys.stdin.read()
"""

# Opens the event handle argv[1] with the IPC timeout argv[2]; one line:
# "OPENED", "ERROR <name> <seconds>" or "KeyboardInterrupt <now> <seconds>".
STALLED_EVENT_IMPORTER_SRC = r"""
import signal, sys, time
# Ctrl-C must reach this child as KeyboardInterrupt even where the test
# runner was started with SIGINT ignored (a background job of a shell
# without job control: Python then installs no handler of its own).
signal.signal(signal.SIGINT, signal.default_int_handler)
import usmipc
usmipc.set_ipc_timeout(float(sys.argv[2]))
raw = bytes.fromhex(sys.argv[1])
print("opening", flush=True)
t0 = time.monotonic()
try:
    try:
        usmipc.IPCEventHandle.open(raw)
        print("OPENED", flush=True)
    except usmipc.Error as e:
        print("ERROR", e.name, repr(time.monotonic() - t0), flush=True)
    time.sleep(1)  # a late KeyboardInterrupt surfaces here
except KeyboardInterrupt:
    t = time.monotonic()
    print("KeyboardInterrupt", repr(t), repr(t - t0), flush=True)
"""


@pytest.fixture
def stalled_event_exporter():
    """A helper that exported an event, then SIGSTOPped: its broker never
    answers a first open."""
    proc = subprocess.Popen([sys.executable, "-c", EVENT_EXPORTER_SRC],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT)
        assert ready, "the exporter did not start"
        raw = bytes.fromhex(proc.stdout.readline().strip())
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    break
            time.sleep(0.01)
        yield raw
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(TIMEOUT)
        proc.stdin.close()
        proc.stdout.close()


def _start_stalled_importer(raw, timeout_s):
    proc = subprocess.Popen(
        [sys.executable, "-c", STALLED_EVENT_IMPORTER_SRC, raw.hex(),
         str(timeout_s)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=child_env(USMIPC_FD_TRANSPORT="socket"))
    ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT)
    line = proc.stdout.readline() if ready else b""
    if line.strip() != b"opening":
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the importer did not start: {line!r} {out!r} {err!r}")
    return proc


def test_ctrl_c_interrupts_an_event_open(stalled_event_exporter):
    proc = _start_stalled_importer(stalled_event_exporter, 30)
    time.sleep(0.3)
    t_signal = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=TIMEOUT)
    words = out.decode().split()
    assert words and words[0] == "KeyboardInterrupt", (out, err)
    latency = float(words[1]) - t_signal
    assert float(words[2]) >= 0.25, f"interrupted too early: {out}"
    assert latency < SIGNAL_LATENCY, f"{latency:.3f} s after SIGINT"


def test_event_open_deadline(stalled_event_exporter):
    proc = _start_stalled_importer(stalled_event_exporter, 0.5)
    out, err = proc.communicate(timeout=TIMEOUT)
    words = out.decode().split()
    assert words[:2] == ["ERROR", "USMIPC_ETIMEDOUT"], (out, err)
    assert 0.4 <= float(words[2]) <= 1.5, out


# ---- ordered memory handles -------------------------------------------------------


def _memory_importer(conn, handles, nbytes):
    """Opens each handle (bytes, or pickled IPCMemoryHandle) every way and
    reports what it read; writes pattern 9 through the last one."""
    try:
        out = []
        for h in handles:
            raw = h if isinstance(h, bytes) else h.to_bytes()
            info = IPCMemoryHandle.inspect(raw)
            reads = []
            for kwargs in ({}, {"ordered": False}, {"stream": 0},
                           {"stream": Queue("host:cpu")},
                           {"stream": Queue.from_stream(0, "host:cpu")}):
                with IPCMemoryHandle.open(h, **kwargs) as m:
                    reads.append(bytes(m.copy_to_host()) == pattern(nbytes, 1))
            out.append((info["is_ordered"], info["event_point"], reads))
        with IPCMemoryHandle.open(handles[-1], "host:cpu", stream=0) as m:
            m.copy_from_host(pattern(nbytes, 9))
        conn.send(("ok", out))
    except BaseException as e:
        conn.send(("error", repr(e)))


def test_ordered_handoffs_open_in_a_spawned_process(host):
    nbytes = 1 << 16
    mem = MemoryUSMDevice(nbytes, device=host)
    mem.copy_from_host(pattern(nbytes, 1))
    h = IPCMemoryHandle(mem)
    assert h.ordered is True and h.queue is mem.queue
    assert "ordered" in repr(h)
    b1 = h.to_bytes()
    b2 = h.to_bytes()
    # The host's queue is always idle: the second handoff may name the
    # first's record, complete (test_order_reuse_and_its_switch).
    i1, i2 = IPCMemoryHandle.inspect(b1), IPCMemoryHandle.inspect(b2)
    assert i1["is_ordered"] and i2["is_ordered"]
    assert i2["event_point"] >= i1["event_point"] > 0
    assert not i1["is_event"]
    # the handle object stands for its latest handoff
    assert IPCMemoryHandle.inspect(h)["event_point"] == i2["event_point"]
    conn, proc = spawn_peer(_memory_importer, [b1, b2, h], nbytes)
    try:
        reply = recv_from(conn, proc)
        assert reply[0] == "ok", reply
        results = reply[1]
        assert [r[0] for r in results] == [True, True, True]
        assert results[1][1] >= results[0][1]
        assert results[2][1] >= results[1][1]  # pickled: a handoff too
        assert all(all(r[2]) for r in results), results
    finally:
        conn.close()
        join_ok(proc)
    assert bytes(mem.copy_to_host()) == pattern(nbytes, 9)


def test_order_reuse_and_its_switch():
    """Handoffs from an idle queue (the host's always is) name one completed
    record instead of recording an event each; USMIPC_ORDER_REUSE=0 records
    one per handoff, as before; a malformed value warns and keeps reuse."""
    source = """
        import usmipc
        from usmipc.memory import MemoryUSMDevice, IPCMemoryHandle
        mems = [MemoryUSMDevice(4096, device="host:cpu") for _ in range(10)]
        h = IPCMemoryHandle(mems[0])
        usmipc.reset_stats()
        raws = [h.to_bytes() for _ in range(10)]
        raws += [IPCMemoryHandle(m).to_bytes() for m in mems[1:]]
        points = [IPCMemoryHandle.inspect(r)["event_point"] for r in raws]
        print(usmipc.stats()["event_records"], len(set(points)))
    """
    # (records made, distinct event points) of the 19 handoffs: the first
    # records, the rest name its record, complete.
    for value, expect in ((None, (1, 1)), ("0", (19, 19)), ("1", (1, 1)),
                          ("yes", (1, 1))):
        env = dict(os.environ)
        env.pop("USMIPC_ORDER_REUSE", None)
        if value is not None:
            env["USMIPC_ORDER_REUSE"] = value
        proc = run_python(source, env=env)
        assert proc.returncode == 0, proc.stderr.decode()
        assert tuple(map(int, proc.stdout.split())) == expect, value
        warned = b"USMIPC_ORDER_REUSE='yes' is malformed" in proc.stderr
        assert warned == (value == "yes"), proc.stderr.decode()


def test_unordered_handles_are_stable_and_free(host):
    mem = MemoryUSMDevice(4096, device=host)
    plain = IPCMemoryHandle(mem, ordered=False)
    raw = plain.to_bytes()
    assert plain.to_bytes() is raw, "the same bytes object every time"
    assert pickle.loads(pickle.dumps(plain)).to_bytes() == raw
    assert plain.ordered is False and plain.queue is None
    info = IPCMemoryHandle.inspect(raw)
    assert info["is_ordered"] is False and info["event_point"] == 0
    assert len(raw) == 216  # the unordered encoding of a host handle
    # another unordered export of the range gives the same encoding, and an
    # ordered handle the same export with its record on top
    assert IPCMemoryHandle(mem, ordered=False).to_bytes() == raw
    ordered = IPCMemoryHandle(mem)
    ob = ordered.to_bytes()
    assert len(ob) > len(raw) and ordered == plain
    assert {k: v for k, v in IPCMemoryHandle.inspect(ob).items()
            if k not in ("is_ordered", "event_point", "length")} == \
        {k: v for k, v in info.items()
         if k not in ("is_ordered", "event_point", "length")}
    with IPCMemoryHandle.open(raw) as m:
        assert m.nbytes == 4096


def test_open_ordered_bytes_without_waiting(host):
    mem = MemoryUSMDevice(4096, device=host)
    mem.copy_from_host(pattern(4096, 3))
    raw = IPCMemoryHandle(mem).to_bytes()
    for kwargs in ({"ordered": False}, {"ordered": False, "stream": 0},
                   {"ordered": True}, {"nbytes": 16, "ordered": False}):
        m = IPCMemoryHandle.open(raw, host, **kwargs)
        assert bytes(m.copy_to_host()) == pattern(4096, 3)[:m.nbytes]
        m.close()
    # handle= is the old keyword of handle_bytes
    with IPCMemoryHandle.open(handle=raw, ordered=False) as m:
        assert m.nbytes == 4096
    with pytest.raises(TypeError, match="handle_bytes"):
        IPCMemoryHandle.open(raw, handle=raw)
    with pytest.raises(TypeError, match="handle_bytes"):
        IPCMemoryHandle.open(device=host)


def test_open_with_a_stream(host):
    mem = MemoryUSMDevice(4096, device=host)
    mem.copy_from_host(pattern(4096, 4))
    h = IPCMemoryHandle(mem)
    q = Queue(host)
    for stream in (q, 0, Queue.from_stream(0, host), None):
        with IPCMemoryHandle.open(h.to_bytes(), stream=stream) as m:
            assert m.device is host
            assert bytes(m.copy_to_host()) == pattern(4096, 4)
    with pytest.raises(ValueError, match="only stream it accepts is 0"):
        IPCMemoryHandle.open(h.to_bytes(), stream=3)
    with pytest.raises(TypeError, match="must be a usmipc.Queue"):
        IPCMemoryHandle.open(h.to_bytes(), stream="s")
    np = pytest.importorskip("numpy")
    with IPCMemoryHandle.open(h.to_bytes(), host, stream=q) as m:
        # a CPU tensor: DLPack's stream must be None, and nothing waits
        a = np.from_dlpack(m)
        assert bytes(a[:8]) == pattern(8, 4)
        del a


def test_ordering_arguments(host):
    mem = MemoryUSMDevice(4096, device=host)
    q = Queue(host)
    h = IPCMemoryHandle(mem, stream=q)
    assert h.queue is q and h.ordered
    assert IPCMemoryHandle(mem, 0, 64, stream=0).queue.native == 0
    h = IPCMemoryHandle(mem, offset=64, nbytes=128, ordered=True)
    assert (h.offset, h.nbytes, h.ordered) == (64, 128, True)
    with pytest.raises(ValueError, match="ordered=False"):
        IPCMemoryHandle(mem, stream=q, ordered=False)
    with pytest.raises(ValueError, match="only stream it accepts is 0"):
        IPCMemoryHandle(mem, stream=1)
    with pytest.raises(TypeError):
        IPCMemoryHandle(mem, stream=object())


def test_ordered_foreign_array(host):
    """Another library's array (a DLPack tensor over usmipc device memory,
    here NumPy's) is ordered on its device's default queue."""
    np = pytest.importorskip("numpy")
    mem = MemoryUSMDevice(4096, device=host)
    mem.copy_from_host(pattern(4096, 5))
    array = np.from_dlpack(mem)
    h = IPCMemoryHandle(array)
    assert h.ordered and h.queue is not None and h.queue.device is host
    b1, b2 = h.to_bytes(), h.to_bytes()
    assert IPCMemoryHandle.inspect(b1)["is_ordered"]
    assert IPCMemoryHandle.inspect(b2)["is_ordered"]
    with IPCMemoryHandle.open(b2) as m:
        assert bytes(m.copy_to_host()) == pattern(4096, 5)
    assert IPCMemoryHandle(array, ordered=False).ordered is False


# ---- Queue.from_stream -------------------------------------------------------------


def test_from_stream_queue_and_int(host):
    q = Queue(host)
    assert Queue.from_stream(q) is q
    assert Queue.from_stream(q, device=host) is q
    assert Queue.from_stream(stream=q, device="host:cpu") is q
    w = Queue.from_stream(0)
    assert isinstance(w, Queue) and w.device is usmipc.Device()
    assert w.native == 0 and w.stream is None and q.native == 0
    w = Queue.from_stream(0, device=host)
    assert w.device is host and "host:cpu:0" in repr(w)
    w.synchronize()
    for bad in (1, 2, 0x7F00DEAD):
        with pytest.raises(ValueError) as info:
            Queue.from_stream(bad, device=host)
        assert info.value.name == "USMIPC_EINVAL"
        assert "no native streams" in str(info.value)
    with pytest.raises(ValueError, match="non-negative"):
        Queue.from_stream(-1)
    for bad in (True, "0", 0.0, object(), None):
        with pytest.raises(TypeError, match="must be a usmipc.Queue"):
            Queue.from_stream(bad)
    with pytest.raises(TypeError):
        Queue.from_stream()


class CudaStreamProtocol:
    """A stream of some CUDA library: only the __cuda_stream__ protocol."""

    def __init__(self, handle=0x1234, version=0):
        self.handle, self.version = handle, version

    def __cuda_stream__(self):
        return (self.version, self.handle)


def _cuda_available():
    return usmipc.backends()["cuda"][0]


def test_from_stream_cuda_protocol_on_the_host(host):
    s = CudaStreamProtocol()
    with pytest.raises(ValueError) as info:
        Queue.from_stream(s, device=host)
    assert info.value.name == "USMIPC_EWRONGDEVICE"
    assert "is not a CUDA device" in str(info.value)
    assert "__cuda_stream__" in str(info.value)
    with pytest.raises(ValueError, match="not a CUDA device"):
        Event(host).record(s)  # the event's device is the host
    if not _cuda_available():
        with pytest.raises(usmipc.Error) as info:
            Queue.from_stream(s)
        assert "no CUDA device" in str(info.value)
    with pytest.raises(ValueError, match="version 0"):
        Queue.from_stream(CudaStreamProtocol(version=1), device=host)
    with pytest.raises(ValueError, match="non-negative"):
        Queue.from_stream(CudaStreamProtocol(handle=-5), device=host)

    class Bad:
        def __cuda_stream__(self):
            return 7

    with pytest.raises(TypeError, match=r"\(version, handle\)"):
        Queue.from_stream(Bad())


def _fake_stream(module, **attrs):
    """An object whose type claims to live in module (torch, cupy) without
    importing it: the resolver must read it through attributes only."""
    cls = type("Stream", (), {"__module__": module})
    obj = cls()
    obj.__dict__.update(attrs)
    return obj


def test_torch_and_cupy_streams_are_read_without_importing_them(host):
    imported = {m for m in ("torch", "cupy") if m in sys.modules}
    torch_like = _fake_stream(
        "torch.cuda.streams", cuda_stream=0,
        device=types.SimpleNamespace(type="cuda", index=3))
    cupy_like = _fake_stream("cupy.cuda.stream", ptr=0, device_id=3)
    for s in (torch_like, cupy_like):
        with pytest.raises(ValueError, match="not a CUDA device"):
            Queue.from_stream(s, device=host)
        if not _cuda_available():
            with pytest.raises(usmipc.Error, match="cuda:gpu:3"):
                Queue.from_stream(s)
    assert {m for m in ("torch", "cupy") if m in sys.modules} == imported


@pytest.mark.skipif(not _cuda_available(), reason="no CUDA device here")
def test_from_stream_keeps_the_stream_object_alive():
    s = CudaStreamProtocol(handle=0)  # the legacy default stream
    q = Queue.from_stream(s)
    assert q.stream is s and q.device.backend == "cuda"
    del s
    gc.collect()
    assert isinstance(q.stream, CudaStreamProtocol)
    q.synchronize()


# ---- Level Zero: no events yet -----------------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[2]
ZE_DRIVER = ROOT / "build" / "tests" / "level_zero" / \
    "libze_usmipc_test_driver.so"

LEVEL_ZERO_SRC = """
import usmipc
from usmipc import Event, IPCEventHandle, Queue
from usmipc.memory import IPCMemoryHandle, MemoryUSMDevice
d = usmipc.Device("level_zero:gpu")
q = Queue(d)
mem = MemoryUSMDevice(4096, device=d)
mem.memset(7)
h = IPCMemoryHandle(mem, release=True)
assert h.ordered is True, h
a, b = h.to_bytes(), h.to_bytes()
assert a != b and IPCMemoryHandle.inspect(a)["is_ordered"]
m = IPCMemoryHandle.open(a, d, stream=q)
assert bytes(m.copy_to_host())[:2] == bytes([7, 7])
IPCMemoryHandle.release(m, stream=q)
IPCMemoryHandle.close_mapping(m)
IPCMemoryHandle.close_mapping(IPCMemoryHandle.open(b, d))
h.wait_released(stream=q)
assert h.releases == (2, 2)
ev = Event(d)
ev.record(q)
ev2 = IPCEventHandle.open(IPCEventHandle(ev).to_bytes())
ev2.wait(q)
ev2.synchronize()
assert ev2.query()
plain = IPCMemoryHandle(mem, ordered=False)
assert plain.to_bytes() is plain.to_bytes()
print("OK")
"""


@pytest.mark.skipif(ctypes.util.find_library("ze_loader") is None,
                    reason="no Level Zero loader (apt-get install libze1)")
@pytest.mark.skipif(not ZE_DRIVER.exists(),
                    reason=f"test driver not built at {ZE_DRIVER}")
def test_level_zero_handles_are_ordered_by_default():
    result = subprocess.run(
        [sys.executable, "-c", LEVEL_ZERO_SRC], capture_output=True,
        timeout=TIMEOUT, env=child_env(ZE_ENABLE_ALT_DRIVERS=ZE_DRIVER))
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert out.splitlines()[-1] == "OK"


# ---- release signals ---------------------------------------------------------


def _releasing_consumer(conn, raws, how):
    """Opens every handoff, then returns the tickets: close_mapping, the
    explicit release() (twice: counted once), or by letting the mapping be
    collected; keeps the last one out until told."""
    import gc
    dev = usmipc.Device("host:cpu")
    maps = [IPCMemoryHandle.open(raw, dev) for raw in raws]
    conn.send([bytes(memoryview(m)[:1])[0] for m in maps])
    for m in maps[:-1]:
        if how == "close":
            IPCMemoryHandle.close_mapping(m)
        elif how == "release":
            IPCMemoryHandle.release(m, stream=Queue(dev))
            IPCMemoryHandle.release(m)
        else:
            pass
    if how == "gc":
        del m
        maps = maps[-1:]
        gc.collect()
    conn.send("some")
    conn.recv()
    IPCMemoryHandle.close_mapping(maps[-1])
    conn.send("all")
    conn.recv()


@pytest.mark.parametrize("how", ["close", "release", "gc"])
def test_release_tickets_come_back_from_a_spawned_process(host, how):
    mem = MemoryUSMDevice(4096, device=host)
    h = IPCMemoryHandle(mem, release=True)
    raws = []
    for i in range(3):
        mem.memset(i + 1)
        raws.append(h.to_bytes())
    assert h.releases == (3, 0)
    assert len({IPCMemoryHandle.inspect(r)["length"] for r in raws}) == 1
    conn, proc = spawn_peer(_releasing_consumer, raws, how)
    try:
        assert recv_from(conn, proc) == [3, 3, 3]  # one memory, the last fill
        assert recv_from(conn, proc) == "some"
        assert h.releases == (3, 2)
        usmipc.set_event_timeout(0.3)
        with pytest.raises(usmipc.Error) as e:
            h.wait_released()
        assert e.value.name == "USMIPC_ETIMEDOUT"
        assert "2 of 3" in str(e.value)
        usmipc.set_event_timeout(None)
        conn.send("go")
        assert recv_from(conn, proc) == "all"
        h.wait_released()
        h.wait_released(stream=Queue(host))
        assert h.releases == (3, 3)
        conn.send("done")
        join_ok(proc)
    finally:
        usmipc.set_event_timeout(None)


def test_release_arguments(host):
    mem = MemoryUSMDevice(4096, device=host)
    h = IPCMemoryHandle(mem, ordered=False, release=True)
    raw = h.to_bytes()
    assert IPCMemoryHandle.inspect(raw)["is_ordered"] is False
    m = IPCMemoryHandle.open(raw, host)
    IPCMemoryHandle.release(m)
    IPCMemoryHandle.release(m)  # once only
    assert h.releases == (1, 1)
    IPCMemoryHandle.close_mapping(m)
    assert h.releases == (1, 1)
    plain = IPCMemoryHandle(mem)
    assert plain.releases == (0, 0)
    plain.wait_released()  # nothing handed out
    with pytest.raises(ValueError, match="made from bytes"):
        IPCMemoryHandle.from_bytes(raw).wait_released()
    with pytest.raises(usmipc.Error, match="non-IPC"):
        IPCMemoryHandle.release(mem)
    # A producer that freed its handle: the consumer's return is no error.
    raw2 = h.to_bytes()
    m2 = IPCMemoryHandle.open(raw2, host)
    del h
    gc.collect()
    IPCMemoryHandle.close_mapping(m2)
