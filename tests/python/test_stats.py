"""usmipc.stats() and usmipc.reset_stats(): the counters of what IPC costs a
process. 50 pool blocks shared with a spawned process cost one driver
export (the producer) and one driver import and one descriptor (the
consumer); sharing them again costs none of these."""

import multiprocessing

import usmipc
from usmipc.memory import IPCMemoryHandle, MemoryPool

from conftest import HOST, TIMEOUT, run_python

FIELDS = {"driver_exports", "driver_imports", "driver_queries",
          "descriptors_sent", "descriptors_received", "transport_exchanges",
          "event_records", "event_waits"}


def test_stats_fields_and_reset():
    proc = run_python("""
        import usmipc
        from usmipc.memory import MemoryUSMDevice, IPCMemoryHandle
        s = usmipc.stats()
        assert set(s) == %r, s
        assert all(isinstance(v, int) and v >= 0 for v in s.values()), s
        m = MemoryUSMDevice(4096, device="host:cpu")
        IPCMemoryHandle(m, ordered=False).to_bytes()
        assert usmipc.stats()["driver_exports"] == s["driver_exports"] + 1
        assert usmipc.reset_stats() is None
        assert set(usmipc.stats().values()) == {0}, usmipc.stats()
        print("ok")
    """ % (FIELDS,))
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().strip() == "ok"


def _consumer(conn):
    dev = usmipc.Device(HOST)
    usmipc.reset_stats()
    while True:
        raws = conn.recv()
        if raws is None:
            return
        maps = [IPCMemoryHandle.open(r, dev) for r in raws]
        values = [bytes(memoryview(m)[:1])[0] for m in maps]
        for m in maps:
            IPCMemoryHandle.close_mapping(m)
        conn.send((values, usmipc.stats()))


def _delta(after, before):
    return {k: after[k] - before[k] for k in FIELDS}


def test_second_share_costs_no_driver_work():
    pool = MemoryPool(1 << 20, device=HOST)
    blocks = [pool.allocate(1000 + i) for i in range(50)]
    for i, b in enumerate(blocks):
        b.memset(i + 1)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child,))
    proc.start()
    try:
        usmipc.reset_stats()
        seen = []
        mine = [usmipc.stats()]
        for _ in range(2):
            # Fresh handles each round, as a producer sharing again makes.
            parent.send([IPCMemoryHandle(b).to_bytes() for b in blocks])
            assert parent.poll(TIMEOUT)
            values, theirs = parent.recv()
            assert values == [i + 1 for i in range(50)]
            seen.append(theirs)
            mine.append(usmipc.stats())
        # The producer: one export of the segment, at most one descriptor
        # sent (none when the consumer takes it with pidfd_getfd).
        first = _delta(mine[1], mine[0])
        assert first["driver_exports"] == 1, first
        assert first["descriptors_sent"] <= 1, first
        # The consumer: one import and one descriptor for 50 blocks.
        assert seen[0]["driver_imports"] == 1, seen[0]
        assert seen[0]["descriptors_received"] == 1, seen[0]
        # Round two: nothing of either.
        again = _delta(mine[2], mine[1])
        assert again["driver_exports"] == 0 and again["descriptors_sent"] == 0, again
        theirs = _delta(seen[1], seen[0])
        assert theirs["driver_imports"] == 0, theirs
        assert theirs["descriptors_received"] == 0, theirs
        parent.send(None)
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
