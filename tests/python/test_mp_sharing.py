"""multiprocessing moves usmipc device memory as the memory itself (an IPC
mapping, no copy) with every start method and through
concurrent.futures.ProcessPoolExecutor, also when the sender drops its last
reference right after put(); plain pickle makes a copy, as dpctl does."""
import concurrent.futures
import gc
import multiprocessing
import pickle
import threading
import time

import pytest

import usmipc
from usmipc.memory import MemoryIPCDevice, MemoryUSMDevice, MemoryUSMHost

from conftest import TIMEOUT, KeptSince

HOST = "host:cpu"


def pattern(n, seed):
    return bytes((i * 7 + seed) % 251 for i in range(n))


def _child(q, results):
    for _ in range(2):
        m = q.get(timeout=TIMEOUT)
        ok = isinstance(m, MemoryIPCDevice) and isinstance(m, MemoryUSMDevice)
        data = bytes(m.copy_to_host())
        m.copy_from_host(b"from child")  # lands in the sender's memory
        results.put((ok, data == pattern(4096, 5), len(data)))
        del m  # closes the mapping: the sender's ticket comes back
        gc.collect()


def temporary():
    mem = MemoryUSMDevice(4096, device=usmipc.Device(HOST))
    mem.copy_from_host(pattern(4096, 5))
    return mem


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_queue_moves_the_memory_itself(method):
    ctx = multiprocessing.get_context(method)
    q, results = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_child, args=(q, results))
    p.start()
    kept = temporary()
    q.put(temporary())  # the only reference goes with the put
    gc.collect()
    assert results.get(timeout=TIMEOUT) == (True, True, 4096)
    q.put(kept)
    assert results.get(timeout=TIMEOUT) == (True, True, 4096)
    p.join(TIMEOUT)
    assert p.exitcode == 0
    assert bytes(kept.copy_to_host())[:10] == b"from child"  # no copy anywhere


def _pool_task(mem):
    data = bytes(mem.copy_to_host())
    mem.copy_from_host(b"pool")
    return type(mem).__name__, data == pattern(4096, 5)


def test_process_pool_executor():
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
        mem = temporary()
        assert ex.submit(_pool_task, mem).result(TIMEOUT) == \
            ("MemoryIPCDevice", True)
        assert bytes(mem.copy_to_host())[:4] == b"pool"
        # a temporary: the pool's feeder pickles it after submit() returned
        assert ex.submit(_pool_task, temporary()).result(TIMEOUT)[1]


def test_plain_pickle_is_a_copy():
    mem = temporary()
    again = pickle.loads(pickle.dumps(mem))
    assert type(again) is MemoryUSMDevice and again._pointer != mem._pointer
    assert bytes(again.copy_to_host()) == bytes(mem.copy_to_host())
    host = MemoryUSMHost(8, device=usmipc.Device(HOST))
    host.memset(9)
    copy = pickle.loads(pickle.dumps(host))
    assert type(copy) is MemoryUSMHost
    assert bytes(copy.copy_to_host()) == b"\t" * 8
    m = usmipc.memory.IPCMemoryHandle.open(
        usmipc.memory.IPCMemoryHandle(mem).to_bytes())
    assert type(pickle.loads(pickle.dumps(m))) is MemoryUSMDevice
    m.close()
    with pytest.raises(ValueError, match="closed"):
        pickle.dumps(m)


def _held_bytes():
    """Bytes of usmipc host allocations mapped in this process (memfds named
    "usmipc", not the export table)."""
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith("/memfd:usmipc (deleted)"):
                lo, hi = line.split()[0].split("-")
                total += int(hi, 16) - int(lo, 16)
    return total


def _close_all(q, done, go, n):
    got = [q.get(timeout=TIMEOUT) for _ in range(n)]
    for m in got:
        m.close()  # returns the sender's ticket
    done.put(len(got))
    go.get(timeout=TIMEOUT)  # alive until the sender has looked


@pytest.mark.usefixtures("leftovers_aside")
def test_sender_frees_when_tickets_return():
    """The sender holds what it put only until the receiver is done: once
    the receiver closed all 20 mappings, the 20 MiB are freed without
    another put() (before, the reducer dropped handles whose tickets had
    come back only at its next put())."""
    ctx = multiprocessing.get_context("spawn")
    q, done, go = ctx.Queue(), ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_close_all, args=(q, done, go, 20))
    p.start()
    try:
        base = _held_bytes()
        for _ in range(20):
            mem = MemoryUSMDevice(1 << 20, device=usmipc.Device(HOST))
            q.put(mem)  # the only reference goes with the put
            del mem
        assert done.get(timeout=TIMEOUT) == 20
        deadline = time.monotonic() + 5
        while _held_bytes() > base and time.monotonic() < deadline:
            time.sleep(0.05)
        held = _held_bytes() - base
        assert held == 0, f"{held >> 20} MiB still held 5 s after the " \
            "receiver closed every mapping"
        assert not usmipc.memory._kept
    finally:
        go.put(None)
        p.join(TIMEOUT)
    assert p.exitcode == 0


def _hold_mapping_until_exit(q, out):
    """Keeps what it received in a global and leaves (fork and forkserver
    children by os._exit, after multiprocessing's finalizers)."""
    global _held
    _held = q.get(timeout=TIMEOUT)
    out.put(bytes(_held.copy_to_host()))


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_receiver_that_exits_holding_a_mapping_returns_its_ticket(method):
    """A receiver that still holds the mapping when it ends gives its
    ticket back as it exits, so the sender frees the memory then (before,
    only when the sender itself exited)."""
    ctx = multiprocessing.get_context(method)
    q, out = ctx.Queue(), ctx.Queue()
    kept = KeptSince()
    p = ctx.Process(target=_hold_mapping_until_exit, args=(q, out))
    p.start()
    mem = MemoryUSMDevice(64, device=usmipc.Device(HOST))
    mem.copy_from_host(pattern(64, 3))
    q.put(mem)
    del mem
    assert out.get(timeout=TIMEOUT) == pattern(64, 3)
    p.join(TIMEOUT)
    assert p.exitcode == 0
    assert [h.releases for h in kept.after_waiting()] == []


class _Racy:
    """A kept handle whose last ticket comes back while the reaper looks:
    its counts read (1, 0) the first time and (1, 1) after."""

    _release_key = (1 << 63) + 4242  # no handle of the library's has it

    def __init__(self, state):
        self.state, self.reads = state, 0

    @property
    def releases(self):
        self.reads += 1
        return (1, 0) if self.reads == 1 else (1, 1)

    def wait_released(self):
        self.state["waited"] = True


class _Back:
    _release_key = (1 << 63) + 4243
    releases = (1, 1)

    def wait_released(self):
        pass


@pytest.mark.usefixtures("leftovers_aside")
def test_reaper_waits_for_every_handle_it_drops():
    """A handle is dropped (its memory freed) only after its wait_released
    ran, also when its ticket comes back while the reaper looks. The
    reaper of before read each handle's counts twice (which are back, which
    stay) and dropped such a handle unwaited: PyTorch's test_cuda_send_many
    then read a later tensor's value (1 item in 100,000, H100, run 48)."""
    import weakref
    from usmipc import memory
    state = {"waited": False}
    dropped = []
    racy = _Racy(state)
    weakref.finalize(racy, lambda: dropped.append(state["waited"]))
    memory._keep(_Back())
    memory._keep(racy)
    del racy
    deadline = time.monotonic() + 5
    while not dropped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dropped == [True]


class _BackToo:
    _release_key = (1 << 63) + 4244
    releases = (1, 1)

    def wait_released(self):
        pass


def _until(cond, limit=5.0):
    deadline = time.monotonic() + limit
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()


@pytest.mark.usefixtures("leftovers_aside")
def test_reaper_outlives_an_empty_moment(monkeypatch):
    """The reaper thread stays through a moment with nothing kept: a sender
    whose receivers return each message's ticket before the next put
    (a weight-update loop, torch_mp_bench's repeated tensor) started a
    thread per message, and Thread.start() waits for the thread to run
    (about 0.28 ms of one tensor's 0.32 ms dumps on an H200, run 55). It
    ends once nothing was kept for _REAPER_LINGER_S, and a handle kept
    while it lingers is still dropped at its next wake."""
    from usmipc import memory
    monkeypatch.setattr(memory, "_REAPER_LINGER_S", 1.0, raising=False)
    memory._keep(_Back())
    assert _until(lambda: not memory._kept_handles())
    first = memory._reaper
    assert first is not None and first.is_alive()
    dropped = []
    h = _BackToo()
    import weakref
    weakref.finalize(h, lambda: dropped.append(True))
    memory._keep(h)
    del h
    assert memory._reaper is first  # no thread started for it
    assert _until(lambda: dropped == [True], 2.0)
    assert _until(lambda: memory._reaper is None, 5.0)
    assert not first.is_alive() or _until(lambda: not first.is_alive(), 2.0)


class _BackThree:
    _release_key = (1 << 63) + 4245
    releases = (1, 1)

    def wait_released(self):
        pass


@pytest.mark.usefixtures("leftovers_aside")
def test_a_reaper_that_fails_is_replaced(monkeypatch):
    """A reaper whose wait raises ends, and the next handle kept starts
    another, which drops what the first left: before, the dead thread
    stayed on record and no handle was dropped again."""
    import weakref
    from usmipc import memory
    assert _until(lambda: not memory._kept_handles())
    real = memory._usmipc._releases_wait
    calls = []

    def failing(*args):
        calls.append(args)
        raise RuntimeError("the reaper's wait failed (test)")

    memory._keep(_Back())  # a reaper runs, then lingers
    assert _until(lambda: not memory._kept_handles())
    first = memory._reaper
    assert first is not None and first.is_alive()
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    monkeypatch.setattr(memory._usmipc, "_releases_wait", failing)
    assert _until(lambda: not first.is_alive())  # its next wake failed
    assert calls and memory._reaper is None
    monkeypatch.setattr(memory._usmipc, "_releases_wait", real)
    dropped = []
    h = _BackThree()
    weakref.finalize(h, lambda: dropped.append(True))
    memory._keep(h)
    del h
    assert _until(lambda: dropped == [True])


def test_releases_wait_refuses_negative_counts():
    """The reaper's wait takes a position in the log and a limit in ms;
    a negative one is a bug and is refused, not wrapped to 2**64-1 (which
    would wait for ever, or read the log from its far end)."""
    from usmipc import _usmipc
    keys, seq, missed = _usmipc._releases_wait(0, 0)
    assert isinstance(keys, tuple) and seq >= 0 and missed in (True, False)
    for args in ((-1, 0), (0, -1), (2**64, 0)):
        with pytest.raises(OverflowError):
            _usmipc._releases_wait(*args)
    with pytest.raises(TypeError):
        _usmipc._releases_wait(0, 1.5)


def test_what_travels_as_a_copy_says_so():
    """Under ForkingPickler (queues, pipes, pools) host and shared memory
    and mappings of another process's memory are copies: each says so with
    a CopyWarning naming what to use instead; device memory, shared by
    reference, warns nothing."""
    import warnings
    from multiprocessing.reduction import ForkingPickler
    from usmipc.memory import CopyWarning, IPCMemoryHandle, MemoryUSMShared
    dev = usmipc.Device(HOST)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ForkingPickler.dumps(MemoryUSMDevice(64, device=dev))  # no warning
    cases = [(MemoryUSMHost(64, device=dev), r"MemoryUSMHost of 64 bytes "
              r"goes to the other process as a copy \(only device memory is "
              r"shared; this is host memory\).*allocate MemoryUSMDevice"),
             (MemoryUSMShared(32, device=dev), r"this is shared memory")]
    exporter = MemoryUSMDevice(16, device=dev)
    mapping = IPCMemoryHandle.open(IPCMemoryHandle(exporter).to_bytes())
    cases.append((mapping, r"MemoryIPCDevice of 16 bytes .*maps another "
                  r"process's memory.*send the handle bytes"))
    for mem, said in cases:
        with pytest.warns(CopyWarning, match=said):
            data = ForkingPickler.dumps(mem)
        again = pickle.loads(data)
        assert type(again) is not MemoryIPCDevice  # a copy, of the bytes
        assert bytes(again.copy_to_host()) == bytes(mem.copy_to_host())
    assert issubclass(CopyWarning, UserWarning)
