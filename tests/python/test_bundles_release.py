"""Release tickets of bundles on host memory: share(..., release=True) hands
one out with every to_bytes(); a consumer process writes into every array
and returns it (release_shared, close_shared, collection, or the bytes);
the producer's wait_released() ends only then and sees the writes. Counts,
a ticket returned twice, forged and ticketless bytes, a consumer that dies,
and the arguments, each with its own outcome."""

import gc
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import usmipc
from usmipc.memory import MemoryPool

from conftest import (TIMEOUT, join_ok, probe_exception, recv_from, reseal,
                      spawn_peer)

HOST = "host:cpu"
# The ticket record (0x8003: u64 release id, u64 ticket, 16-byte token)
# ends right before a bundle's checksum.
TOKEN_AT = -4 - 16


@pytest.fixture(autouse=True)
def _event_timeout():
    yield
    usmipc.set_event_timeout(None)


def _tree(pool):
    """Three float32 arrays over two pool blocks, filled with 1, 2, 3."""
    a = np.from_dlpack(pool.allocate(4096)).view(np.float32)
    b = np.from_dlpack(pool.allocate(1024)).view(np.float32)
    tree = {"w": a[:512].reshape(16, 32), "layers": [a[512:], b]}
    for i, x in enumerate((tree["w"], *tree["layers"])):
        x[...] = i + 1
    return tree


def _leaves(tree):
    return [tree["w"], *tree["layers"]]




def _write(tree):
    """10 + index into every array (no leaf stays referenced here: the last
    array of an open to die returns its ticket)."""
    for i, leaf in enumerate(_leaves(tree)):
        np.from_dlpack(leaf)[...] = 10 + i


def _writing_consumer(conn, raw, how):
    """Opens the bundle, writes 10 + index into every array, waits for the
    word, then returns the ticket as `how` says; then returns it again
    (counted once, and sent no more: the open knows it went back)."""
    dev = usmipc.Device(HOST)
    tree = usmipc.open_shared(raw, device=dev)
    _write(tree)
    conn.send("written")
    conn.recv()
    if how == "release":
        usmipc.release_shared(tree, stream=usmipc.Queue(dev))
    elif how == "close":
        usmipc.close_shared(tree)  # the last close returns it, from the host
    elif how == "close-stream":
        usmipc.close_shared(tree, stream=usmipc.Queue(dev))
    elif how == "gc":
        del tree
        gc.collect()
    elif how == "bytes":
        usmipc.release_shared(raw, stream=usmipc.Queue(dev))
    sent = usmipc.stats()["transport_exchanges"]
    conn.send("returned")
    conn.recv()
    if how in ("release", "bytes"):
        usmipc.release_shared(tree)
        usmipc.release_shared(raw)
        usmipc.close_shared(tree)
    conn.send(usmipc.stats()["transport_exchanges"] - sent)
    conn.recv()


@pytest.mark.parametrize("how", ["release", "close", "close-stream", "gc",
                                 "bytes"])
def test_wait_released_ends_after_the_consumer_wrote(how):
    pool = MemoryPool(device=usmipc.Device(HOST))
    tree = _tree(pool)
    bundle = usmipc.share(tree, release=True)
    assert bundle.releases == (0, 0)
    raw = bundle.to_bytes()
    assert bundle.releases == (1, 0)
    usmipc.set_event_timeout(0.3)
    with pytest.raises(usmipc.Error) as e:
        bundle.wait_released()
    assert e.value.name == "USMIPC_ETIMEDOUT" and "0 of 1" in str(e.value)
    usmipc.set_event_timeout(None)

    conn, proc = spawn_peer(_writing_consumer, raw, how)
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(
        bundle.wait_released(stream=usmipc.Queue(usmipc.Device(HOST)))))
    try:
        assert recv_from(conn, proc) == "written"
        waiter.start()
        time.sleep(0.2)
        assert waiter.is_alive(), "wait_released() ended before the release"
        assert bundle.releases == (1, 0)
        conn.send("go")
        assert recv_from(conn, proc) == "returned"
        waiter.join(TIMEOUT)
        assert not waiter.is_alive() and outcome == [None]
        assert bundle.releases == (1, 1)
        for i, leaf in enumerate(_leaves(tree)):
            assert (leaf == 10 + i).all(), f"array {i} lacks the writes"
        conn.send("again")
        assert recv_from(conn, proc) == 0  # nothing sent a second time
        assert bundle.releases == (1, 1)
        bundle.wait_released()
        conn.send("done")
        join_ok(proc)
    finally:
        if proc.is_alive():
            proc.kill()


def _partial_closer(conn, raw, n):
    """Opens a bundle of n arrays and closes them with close_shared() given
    a list that holds an int after all but one of them: refused, the
    arrays before the int closed, the ticket still out (one array open);
    then closes the rest, which returns it."""
    tree = usmipc.open_shared(raw, device=usmipc.Device(HOST))
    leaves = list(tree.values())
    with pytest.raises(usmipc.ArgumentTypeError,
                       match=r"an int is not a shared array"):
        usmipc.close_shared(leaves[:-1] + [5] + leaves[-1:])
    closed = [leaf.closed for leaf in leaves]
    conn.send(closed)
    conn.recv()
    usmipc.close_shared(tree)
    conn.send([leaf.closed for leaf in leaves])
    conn.recv()


def test_close_shared_refused_part_way_closes_what_came_before():
    """close_shared() closes a tree's mappings in one call: a leaf that is
    not an array stops it there, the arrays before it closed and their
    mappings released, and the ticket goes back with the last array of
    the open, not before."""
    n = 300
    pool = MemoryPool(device=usmipc.Device(HOST))
    mems = [pool.allocate(256) for _ in range(n)]
    tree = {f"p{i}": np.from_dlpack(m).view(np.float32)
            for i, m in enumerate(mems)}
    bundle = usmipc.share(tree, release=True)
    conn, proc = spawn_peer(_partial_closer, bundle.to_bytes(), n)
    try:
        assert recv_from(conn, proc) == [True] * (n - 1) + [False]
        assert bundle.releases == (1, 0)  # one array still open
        conn.send("rest")
        assert recv_from(conn, proc) == [True] * n
        bundle.wait_released()
        assert bundle.releases == (1, 1)
        conn.send("done")
        join_ok(proc)
    finally:
        if proc.is_alive():
            proc.kill()


def _dying_consumer(conn, raw):
    tree = usmipc.open_shared(raw)
    conn.send(len(_leaves(tree)))
    conn.recv()  # killed here, the ticket still out


def test_a_consumer_that_dies_makes_the_wait_time_out():
    pool = MemoryPool(device=usmipc.Device(HOST))
    bundle = usmipc.share(_tree(pool), release=True)
    conn, proc = spawn_peer(_dying_consumer, bundle.to_bytes())
    assert recv_from(conn, proc) == 3
    proc.kill()
    proc.join(TIMEOUT)
    usmipc.set_event_timeout(0.4)
    start = time.monotonic()
    with pytest.raises(usmipc.IPCTimeoutError) as e:
        bundle.wait_released()
    assert time.monotonic() - start >= 0.35
    assert e.value.name == "USMIPC_ETIMEDOUT" and "0 of 1" in str(e.value)
    assert bundle.releases == (1, 0)


def _returning_consumer(conn):
    while True:
        msg = conn.recv()
        if msg is None:
            return
        try:
            usmipc.release_shared(msg)
            conn.send("ok")
        except usmipc.Error as e:
            probe_exception(e, "consumer process: usmipc.release_shared")
            conn.send((e.name, str(e)))


def test_forged_ticketless_and_late_tickets():
    pool = MemoryPool(device=usmipc.Device(HOST))
    bundle = usmipc.share(_tree(pool), release=True)
    raws = [bundle.to_bytes() for _ in range(3)]
    conn, proc = spawn_peer(_returning_consumer)
    try:
        def send(raw):
            conn.send(raw)
            return recv_from(conn, proc)

        forged = bytearray(raws[0])
        forged[TOKEN_AT] ^= 1
        name, message = send(reseal(forged))
        assert name == "USMIPC_EACCES" and "token" in message
        never = bytearray(raws[0])
        never[TOKEN_AT - 8] = 99  # ticket 99: never handed out
        name, message = send(reseal(never))
        assert name == "USMIPC_EBADHANDLE" and "never handed out" in message
        assert bundle.releases == (3, 0)
        assert send(raws[0]) == "ok"
        assert send(raws[0]) == "ok"  # counts once
        assert bundle.releases == (3, 1)
        name, message = send(usmipc.share(_tree(pool)).to_bytes())
        assert name == "USMIPC_EINVAL" and "no release ticket" in message
        # The producer drops the bundle: nobody waits for the tickets still
        # out, and returning one is no error (as for a mapping's).
        del bundle
        gc.collect()
        assert send(raws[1]) == "ok"
        conn.send(None)
        join_ok(proc)
    finally:
        if proc.is_alive():
            proc.kill()


def test_release_arguments():
    import pickle
    dev = usmipc.Device(HOST)
    pool = MemoryPool(device=dev)
    tree = _tree(pool)
    bundle = usmipc.share(tree, ordered=False, release=True)
    assert bundle.releases == (0, 0)
    bundle.wait_released()  # nothing handed out
    raw = bundle.to_bytes()
    assert bundle.to_bytes() != raw  # a ticket of its own each time
    # Pickling is a handoff too; the unpickled bundle is the bytes.
    carried = pickle.loads(pickle.dumps(bundle))
    assert bundle.releases == (3, 0)
    assert carried.releases == (0, 0)
    with pytest.raises(ValueError, match="made from bytes"):
        carried.wait_released()
    usmipc.release_shared(carried)
    assert bundle.releases == (3, 1)
    with pytest.raises(ValueError, match="producer's own"):
        usmipc.release_shared(bundle)
    with pytest.raises(TypeError, match="not a shared array.*to='torch'"):
        usmipc.release_shared({"x": 1})
    # An open in this process: a leaf returns its open's ticket; closing
    # the rest sends nothing more.
    opened = usmipc.open_shared(raw)
    usmipc.release_shared(opened["layers"][1])
    assert bundle.releases == (3, 2)
    usmipc.close_shared(opened)
    usmipc.release_shared(raw)
    assert bundle.releases == (3, 2)
    # Without a ticket: the bytes, their tree and a leaf of it are refused
    # alike (before: the tree and the leaf returned quietly).
    plain = usmipc.share(tree)
    assert plain.releases == (0, 0)
    plain_tree = usmipc.open_shared(plain.to_bytes())
    said = set()
    for what in (plain.to_bytes(), plain_tree, plain_tree["layers"][1]):
        with pytest.raises(usmipc.ArgumentError,
                           match=r"the bundle carries no release ticket "
                                 r"\(its producer did not order it .*"
                                 r"share\(\.\.\., release=True\)") as info:
            usmipc.release_shared(what)
        said.add((str(info.value), info.value.name))
    assert len(said) == 1, said
    # Closing needs no ticket, with a stream or without.
    usmipc.close_shared(plain_tree, stream=usmipc.Queue(dev))
    # A bundle of no memory lends nothing: no ticket, nothing to wait for,
    # as bytes or as a tree.
    empty = usmipc.share({"e": np.from_dlpack(pool.allocate(8))[:0]},
                         release=True)
    usmipc.release_shared(empty.to_bytes())
    usmipc.release_shared(usmipc.open_shared(empty.to_bytes()))
    assert empty.releases == (0, 0)
    empty.wait_released()


def test_to_torch_trees_return_by_bytes():
    torch = pytest.importorskip("torch")
    pool = MemoryPool(device=usmipc.Device(HOST))
    bundle = usmipc.share(_tree(pool), release=True)
    raw = bundle.to_bytes()
    tensors = usmipc.open_shared(raw, to="torch")
    assert isinstance(tensors["w"], torch.Tensor)
    with pytest.raises(TypeError, match="pass the bytes"):
        usmipc.release_shared(tensors)
    usmipc.release_shared(raw)
    assert bundle.releases == (1, 1)
    raw2 = bundle.to_bytes()
    tensors = usmipc.open_shared(raw2, to="torch")
    del tensors  # the tensors die: the ticket goes back from the host
    gc.collect()
    assert bundle.releases == (2, 2)
    bundle.wait_released()


COUNTS_WHILE_WAITING_SRC = r"""
import sys, threading, time
import numpy as np
import usmipc
from usmipc.memory import MemoryPool

pool = MemoryPool(device=usmipc.Device("host:cpu"))
bundle = usmipc.share({"a": np.from_dlpack(pool.allocate(4096))},
                      release=True)
raw = bundle.to_bytes()  # one ticket out, never returned
usmipc.set_event_timeout(2.0)
outcome = []

def wait():
    try:
        bundle.wait_released()
    except usmipc.Error as e:
        outcome.append(e.name)

waiter = threading.Thread(target=wait)
waiter.start()
n = 0
while waiter.is_alive():
    bundle.releases  # the GIL held, the library's lock wanted
    n += 1
print(outcome, n, flush=True)
"""


def test_counts_while_wait_released_waits():
    """bundle.releases on one thread while wait_released waits on another:
    the wait asks the interrupt hook (which takes the GIL) every 50 ms, and
    must not hold the library's lock while it does, or the thread that holds
    the GIL and wants that lock deadlocks with it (the behaviour probe saw
    test_wait_released_ends_after_the_consumer_wrote hang so)."""
    proc = subprocess.run([sys.executable, "-c", COUNTS_WHILE_WAITING_SRC],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("['USMIPC_ETIMEDOUT']"), proc.stdout


def _fanout_consumer(conn, raw, rank):
    """A tensor-parallel rank: opens the broadcast bytes, writes its own
    array, returns the ticket on the word, then twice more (an open of its
    own again, and the bytes): counted once."""
    tree = usmipc.open_shared(raw, device=usmipc.Device(HOST))
    np.from_dlpack(_leaves(tree)[rank])[...] = 100 + rank
    conn.send("written")
    conn.recv()
    usmipc.release_shared(tree)
    again = usmipc.open_shared(raw, device=usmipc.Device(HOST))
    usmipc.release_shared(again)
    usmipc.release_shared(raw)
    conn.send("returned")
    conn.recv()


def test_fanout_waits_for_every_consumer():
    pool = MemoryPool(device=usmipc.Device(HOST))
    tree = _tree(pool)
    bundle = usmipc.share(tree, release=True)
    raw = bundle.to_bytes(consumers=3)  # one event, one ticket, three ranks
    assert bundle.releases == (3, 0)
    peers = [spawn_peer(_fanout_consumer, raw, rank) for rank in range(3)]
    try:
        for conn, proc in peers:
            assert recv_from(conn, proc) == "written"
        usmipc.set_event_timeout(0.3)
        for i, (conn, proc) in enumerate(peers[:2]):
            conn.send("go")
            assert recv_from(conn, proc) == "returned"
            assert bundle.releases == (3, i + 1)  # each counted once
            with pytest.raises(usmipc.IPCTimeoutError,
                               match=f"{i + 1} of 3"):
                bundle.wait_released()
        conn, proc = peers[2]
        conn.send("go")
        assert recv_from(conn, proc) == "returned"
        assert bundle.releases == (3, 3)
        bundle.wait_released()
        for rank, leaf in enumerate(_leaves(tree)):
            assert (leaf == 100 + rank).all()
        for conn, proc in peers:
            conn.send("done")
            join_ok(proc)
    finally:
        for _, proc in peers:
            if proc.is_alive():
                proc.kill()
    # The next handoff to one consumer counts as before; bad counts refused.
    bundle.to_bytes()
    assert bundle.releases == (4, 3)
    for bad in (0, 4097, -1):
        with pytest.raises(usmipc.ArgumentError, match="1 to 4096"):
            bundle.to_bytes(consumers=bad)
    with pytest.raises(usmipc.ArgumentTypeError):
        bundle.to_bytes(consumers="3")
    with pytest.raises(usmipc.ArgumentError, match="release=True"):
        usmipc.share(tree).to_bytes(consumers=2)


def test_release_stream_is_asked_when_the_last_array_goes():
    """open_shared(release_stream=f): f() is called once, when the open's
    last array is closed or collected, and the ticket goes back after the
    work on the stream it returns (usmipc.torch passes the receiver's
    current torch stream). A failing f, or one that returns no stream,
    still returns the ticket (from the host) and reports the error as
    unraisable: a producer must not wait forever for it."""
    dev = usmipc.Device(HOST)
    pool = MemoryPool(device=dev)
    bundle = usmipc.share(_tree(pool), ordered=False, release=True)
    calls = []

    def current():
        calls.append(len(calls))
        return usmipc.Queue(dev)

    opened = usmipc.open_shared(bundle.to_bytes(), release_stream=current)
    w = opened["w"]
    del opened
    gc.collect()
    assert calls == [] and bundle.releases == (1, 0)  # w still lives
    w.close()
    assert calls == [0] and bundle.releases == (1, 1)
    del w
    gc.collect()
    assert calls == [0]  # once per open

    seen = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append(u.exc_value)
    try:
        for bad in (lambda: 1 / 0, lambda: 5):
            sent = bundle.releases[0]
            tree = usmipc.open_shared(bundle.to_bytes(), release_stream=bad)
            del tree
            gc.collect()
            assert bundle.releases == (sent + 1, sent + 1)
    finally:
        sys.unraisablehook = old_hook
    assert isinstance(seen[0], ZeroDivisionError)
    assert len(seen) == 2 and "5" in str(seen[1])
    with pytest.raises(TypeError, match=r"release_stream=.*a function of no "
                                        r"arguments"):
        usmipc.open_shared(b"", release_stream=5)  # checked first
    bundle.wait_released()  # every ticket handed out came back


def _forwarding_consumer(conn, raw):
    """Opens the bundle, hands it on (forward_shared, with its SharedArray
    and with the bytes), then closes when told: its ticket goes back while
    the bytes it handed on are still held elsewhere."""
    tree = usmipc.open_shared(raw)
    fwd = usmipc.forward_shared(tree["w"])
    conn.send(fwd)
    conn.recv()
    usmipc.close_shared(tree)
    conn.send("closed")
    conn.recv()
    try:  # too late: its own ticket went back
        usmipc.forward_shared(raw)
        conn.send("forwarded after release")
    except usmipc.Error as e:
        conn.send((type(e).__name__, e.name, str(e)))
    conn.recv()


def _third_consumer(conn, raw):
    tree = usmipc.open_shared(raw)
    conn.send([float(np.from_dlpack(x).reshape(-1)[0])
               for x in _leaves(tree)])
    conn.recv()
    _write(tree)
    usmipc.close_shared(tree)
    conn.send("closed")
    conn.recv()


def test_a_consumer_hands_the_bundle_on():
    """forward_shared: process B holds the producer's bundle and hands it to
    C with a ticket of its own. The producer's wait goes on after B's
    ticket is back, until C's is, and then sees C's writes."""
    pool = MemoryPool(device=usmipc.Device(HOST))
    tree = _tree(pool)
    bundle = usmipc.share(tree, release=True)
    raw = bundle.to_bytes()
    b, pb = spawn_peer(_forwarding_consumer, raw)
    c = pc = None
    try:
        fwd = recv_from(b, pb)
        assert isinstance(fwd, bytes) and len(fwd) == len(raw) and fwd != raw
        assert fwd[:TOKEN_AT - 8] == raw[:TOKEN_AT - 8]  # the ticket differs
        assert bundle.releases == (2, 0)
        c, pc = spawn_peer(_third_consumer, fwd)
        assert recv_from(c, pc) == [1.0, 2.0, 3.0]
        b.send("close")
        assert recv_from(b, pb) == "closed"
        assert bundle.releases == (2, 1)
        usmipc.set_event_timeout(0.3)
        with pytest.raises(usmipc.IPCTimeoutError, match="1 of 2"):
            bundle.wait_released()
        b.send("again")
        kind, name, said = recv_from(b, pb)
        assert (kind, name) == ("ArgumentError", "USMIPC_EINVAL"), said
        assert "before releasing" in said
        c.send("write")
        assert recv_from(c, pc) == "closed"
        usmipc.set_event_timeout(None)
        bundle.wait_released()
        assert bundle.releases == (2, 2)
        for i, leaf in enumerate(_leaves(tree)):
            assert (leaf == 10 + i).all()
        for conn, proc in ((b, pb), (c, pc)):
            conn.send("done")
            join_ok(proc)
    finally:
        for proc in (pb, pc):
            if proc is not None and proc.is_alive():
                proc.kill()


def test_forward_shared_arguments():
    pool = MemoryPool(device=usmipc.Device(HOST))
    tree = _tree(pool)
    bundle = usmipc.share(tree, release=True)
    with pytest.raises(usmipc.ArgumentError, match="producer's own"):
        usmipc.forward_shared(bundle)
    with pytest.raises(usmipc.ArgumentTypeError, match="not an int"):
        usmipc.forward_shared(3)
    with pytest.raises(usmipc.Error) as e:
        usmipc.forward_shared(b"not a bundle")
    assert e.value.name == "USMIPC_EBADHANDLE"
    unticketed = usmipc.share(tree)
    plain = unticketed.to_bytes()  # no ticket
    with pytest.raises(usmipc.ArgumentError, match="no release|no ticket"):
        usmipc.forward_shared(plain)
    opened = usmipc.open_shared(plain)
    with pytest.raises(usmipc.ArgumentError, match="no release ticket"):
        usmipc.forward_shared(opened["w"])
    usmipc.close_shared(opened)


def test_a_tree_in_a_cycle_is_collected_and_returns_its_ticket():
    """SharedArray leaves are not tracked by the cycle collector (nothing
    they refer to can lead back to them), yet a tree its own containers
    hold in a cycle is still collected: its arrays close and the ticket
    goes back."""
    pool = MemoryPool(device=usmipc.Device(HOST))
    a = np.from_dlpack(pool.allocate(64)).view(np.int32)
    bundle = usmipc.share({"a": a, "b": [a[:4]]}, release=True)
    tree = usmipc.open_shared(bundle.to_bytes())
    assert not gc.is_tracked(tree["a"]) and gc.is_tracked(tree)
    tree["loop"] = [tree]
    del tree
    assert bundle.releases == (1, 0)  # only the collector can free it
    gc.collect()
    deadline = time.monotonic() + TIMEOUT
    while bundle.releases != (1, 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert bundle.releases == (1, 1)
    bundle.wait_released()
