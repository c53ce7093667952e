"""One rank of tests/python/test_distributed.py (not a test module itself).

    python distributed_rank.py ENGINE SCENARIO OUTDIR

ENGINE is 'torch' (gloo; RANK, WORLD_SIZE, USMIPC_TEST_INIT and
USMIPC_TEST_PG_TIMEOUT in the environment) or 'mpi' (mpi4py under mpirun).
Each rank checks what it sees itself (an AssertionError fails it) and writes
what it saw to OUTDIR/rank<N>.json for the test to compare across ranks.
Memory is usmipc host memory (host:cpu): a memfd every rank of the node maps.
"""
import json
import os
import signal
import sys
import time

import numpy as np

import usmipc
import usmipc.distributed as ud
from usmipc.memory import MemoryUSMDevice

NBYTES = 4096
WORDS = NBYTES // 8
HOST = usmipc.Device("host:cpu")


class Torch:
    def __init__(self):
        import datetime

        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        timeout = float(os.environ.get("USMIPC_TEST_PG_TIMEOUT", "30"))
        dist.init_process_group(
            "gloo", init_method=os.environ["USMIPC_TEST_INIT"],
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=datetime.timedelta(seconds=timeout))
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def exchange(self, mem):
        return ud.exchange(mem)

    def barrier(self):
        self.dist.barrier()

    def allgather(self, obj):
        out = [None] * self.size
        self.dist.all_gather_object(out, obj)
        return out

    def own_buffer(self, mem):
        # Odd ranks pass a torch tensor over the memory (int64 words), even
        # ranks the usmipc memory itself: both kinds in one exchange.
        if self.rank % 2:
            return self.torch.from_dlpack(mem).view(self.torch.int64)
        return mem

    def bad_arguments(self, mem):
        sub = self.dist.new_group([0])  # collective; only rank 0 is in it
        if self.rank != 0:
            try:
                ud.exchange(mem, sub)
                raise AssertionError("exchange() in a group without this rank")
            except ValueError as e:
                assert "not a member" in str(e), str(e)

    def finish(self):
        self.dist.destroy_process_group()


class MPI:
    def __init__(self):
        from mpi4py import MPI as mpi
        self.comm = mpi.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def exchange(self, mem):
        return ud.exchange_mpi(mem, self.comm)

    def barrier(self):
        self.comm.Barrier()

    def allgather(self, obj):
        return self.comm.allgather(obj)

    def own_buffer(self, mem):
        return mem

    def bad_arguments(self, mem):
        from mpi4py import MPI as mpi
        for comm, error, words in ((
                "COMM_WORLD", TypeError, "must be an mpi4py communicator"),
                (mpi.COMM_NULL, ValueError, "COMM_NULL")):
            try:
                ud.exchange_mpi(mem, comm)
                raise AssertionError(f"exchange_mpi took {comm!r}")
            except error as e:
                assert words in str(e), str(e)

    def finish(self):
        pass


def words(entry):
    """int64 words of a rank's buffer as this rank sees it, without a copy:
    usmipc memory, a torch CPU tensor or a SharedArray of host memory."""
    if hasattr(entry, "numpy"):  # torch tensor
        return entry.numpy()
    return np.asarray(memoryview(entry)).view(np.int64)


def fresh_memory(value):
    mem = MemoryUSMDevice(NBYTES, device=HOST)
    w = np.asarray(memoryview(mem)).view(np.int64)
    w[:] = -1
    w[0] = value
    return mem, w


def scenario_basic(eng, out):
    me, n = eng.rank, eng.size
    # A bad buffer on one rank fails the exchange on every rank, and the
    # group is usable afterwards.
    bad = np.zeros(16) if me == 1 else fresh_memory(me)[0]
    try:
        eng.exchange(bad)
        raise AssertionError("an exchange with a bad buffer succeeded")
    except ud.ExchangeError as e:
        assert set(e.failures) == {1}, e.failures
        assert "rank 1 could not share its memory" in str(e), str(e)
        assert (e.__cause__ is not None) == (me == 1), e.__cause__
        out["bad_input_error"] = str(e)

    mem, mine = fresh_memory(me)
    eng.bad_arguments(mem)
    buf = eng.own_buffer(mem)
    t0 = time.perf_counter()
    ex = eng.exchange(buf)
    out["exchange_s"] = time.perf_counter() - t0
    assert len(ex) == n and ex.rank == me
    assert ex.local_ranks == tuple(range(n)), ex.local_ranks
    assert ex.reasons == {}, ex.reasons
    assert ex[me] is buf
    peers = {r: words(ex[r]) for r in range(n)}
    # Every rank reads every other rank's value through the mapping.
    seen = [int(peers[r][0]) for r in range(n)]
    assert seen == list(range(n)), seen
    out["kinds"] = [type(ex[r]).__name__ for r in range(n)]
    eng.barrier()
    # Every rank writes a new value; after a barrier its peers see it (a
    # copy made at the exchange would still hold the old one).
    mine[0] = 100 + me
    # ... and writes into the next rank's buffer, which that rank reads in
    # its own memory. The barrier is the exchange's own (events of the
    # device, handles in one all-gather).
    nxt = (me + 1) % n
    peers[nxt][1 + me] = 1000 * me + nxt
    ex.barrier()
    seen = [int(peers[r][0]) for r in range(n)]
    assert seen == [100 + r for r in range(n)], seen
    prev = (me - 1) % n
    assert int(mine[1 + prev]) == 1000 * prev + me, mine[:n + 1]
    out["after_write"] = seen
    # Again: the barrier's events are recorded anew each time (the first
    # barrier: everyone has read the values above before any is replaced).
    ex.barrier()
    mine[0] = 200 + me
    ex.barrier()
    seen = [int(peers[r][0]) for r in range(n)]
    assert seen == [200 + r for r in range(n)], seen
    del peers
    ex.close()
    try:
        ex.barrier()
        raise AssertionError("barrier() on a closed exchange succeeded")
    except ValueError as e:
        assert "closed" in str(e), e
    assert ex.closed
    try:
        ex[0]
        raise AssertionError("a closed exchange gave an entry")
    except ValueError:
        pass
    ex.close()  # idempotent, and no second collective
    # The context manager closes too.
    with eng.exchange(buf) as ex2:
        assert int(words(ex2[(me + 1) % n])[0]) == 200 + (me + 1) % n
    assert ex2.closed


def scenario_two_nodes(eng, out):
    """Ranks listed in USMIPC_TEST_OTHER_NODE run under another boot id (a
    bind mount in their own mount namespace): another node to usmipc."""
    me, n = eng.rank, eng.size
    other = {int(r) for r in os.environ["USMIPC_TEST_OTHER_NODE"].split(",")}
    node = other if me in other else set(range(n)) - other
    mem, mine = fresh_memory(me)
    ex = eng.exchange(mem)
    assert ex.local_ranks == tuple(sorted(node)), ex.local_ranks
    assert set(ex.reasons) == set(range(n)) - node, ex.reasons
    for r in range(n):
        if r in node:
            assert int(words(ex[r])[0]) == r
        else:
            assert ex[r] is None
    out["reasons"] = {str(r): why for r, why in ex.reasons.items()}
    # The library refuses a handle of the other node by itself, whatever
    # asks it to open one.
    bundle = usmipc.share(mem)
    raws = eng.allgather(bundle.to_bytes())
    refused = {}
    for r in sorted(set(range(n)) - node):
        try:
            usmipc.open_shared(raws[r], device=HOST)
            refused[str(r)] = None
        except usmipc.Error as e:
            refused[str(r)] = [e.name, str(e)]
    out["library_refusals"] = refused
    eng.barrier()
    ex.close()


def scenario_death_after(eng, out):
    """The last rank dies (SIGKILL) after the exchange: the others keep its
    memory mapped and readable, a new open of it fails cleanly, and close()
    fails with the engine's error instead of hanging."""
    me, n = eng.rank, eng.size
    victim = n - 1
    mem, mine = fresh_memory(me)
    ex = eng.exchange(mem)
    keep = usmipc.share(mem)  # bytes for a new open, valid while it lives
    raws = eng.allgather(keep.to_bytes())
    mine[0] = 500 + me
    eng.barrier()
    if me == victim:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    dead = words(ex[victim])
    deadline = time.monotonic() + 30
    while True:  # until the library sees the exporter gone
        try:
            usmipc.close_shared(usmipc.open_shared(raws[victim], device=HOST))
        except usmipc.Error as e:
            out["reopen_error"] = [e.name, str(e)]
            break
        assert time.monotonic() < deadline, "the dead rank still exports"
        time.sleep(0.05)
    out["dead_rank_value"] = int(dead[0])
    dead[1] = 7  # still mapped, still writable
    assert int(dead[1]) == 7
    del dead
    t0 = time.perf_counter()
    try:
        ex.close()
        out["close"] = "returned"
    except ud.ExchangeError as e:
        out["close"] = str(e)
    out["close_s"] = time.perf_counter() - t0
    assert ex.closed


def scenario_death_during(eng, out):
    """The last rank never joins the exchange (it hangs, alive, past the
    group's timeout): the others fail with the engine's own timeout."""
    me, n = eng.rank, eng.size
    if me == n - 1:
        time.sleep(float(os.environ["USMIPC_TEST_PG_TIMEOUT"]) + 5)
        sys.stdout.flush()
        os._exit(0)
    mem, _ = fresh_memory(me)
    t0 = time.perf_counter()
    try:
        eng.exchange(mem)
        out["exchange"] = "returned"
    except Exception as e:  # the engine's error, whatever its class
        out["exchange"] = f"{type(e).__name__}: {e}"[:500]
    out["failed_after_s"] = time.perf_counter() - t0


# Bad records that rank 1 sends in place of its own (the first gather), or
# of its error report (the second gather, when the name starts "report").
BAD_RECORDS = {
    "a list": lambda rec: ["boot", "host", "pid", "bundle", "error"],
    "None": lambda rec: None,
    "no bundle key": lambda rec: {k: v for k, v in rec.items()
                                  if k != "bundle"},
    "no keys": lambda rec: {},
    "pid a string": lambda rec: dict(rec, pid=str(rec["pid"])),
    "pid a bool": lambda rec: dict(rec, pid=True),
    "bundle an int": lambda rec: dict(rec, bundle=7),
    "bundle None without an error": lambda rec: dict(rec, bundle=None),
    "error a list": lambda rec: dict(rec, error=["no"]),
    "boot None": lambda rec: dict(rec, boot=None),
    "host bytes": lambda rec: dict(rec, host=b"node"),
    "report a dict": lambda report: {"error": report},
}


def scenario_bad_records(eng, out):
    """Every honest rank raises ExchangeError naming rank 1, whatever rank 1
    sends in place of its record; then the group still exchanges."""
    me = eng.rank
    cls = ud._TorchEngine if isinstance(eng, Torch) else ud._MPIEngine
    original = cls.allgather
    out["bad_records"] = {}
    for name, forge in BAD_RECORDS.items():
        report = name.startswith("report")
        if me == 1:
            def patched(self, obj, forge=forge, report=report):
                if isinstance(obj, dict) != report:
                    obj = forge(obj)
                return original(self, obj)
            cls.allgather = patched
        mem, _ = fresh_memory(me)
        try:
            eng.exchange(mem)
            raise AssertionError(f"{name}: the exchange succeeded")
        except ud.ExchangeError as e:
            assert set(e.failures) == {1}, (name, e.failures)
            assert str(e).count("rank 1 ") >= 1, (name, str(e))
            out["bad_records"][name] = str(e)
        finally:
            cls.allgather = original
    mem, _ = fresh_memory(me)
    ex = eng.exchange(mem)
    assert len(ex) == eng.size
    ex.close()


# Bundle slots past the exporter's export table (2^20 slots) that rank 1
# writes into its own bundle bytes (offset 24), checksum recomputed: the
# record is well formed, so only the bundle decoder can refuse it.
FORGED_SLOTS = (0x00100005, 0xFFFFFFF0)


def scenario_forged_slot(eng, out):
    """Rank 1 sends bundle bytes whose own slot lies past the export table
    (docs/handle-format.md, "Bundles"), checksum recomputed. The decoder
    used to read outside its mapping of rank 1's table (SIGSEGV for
    0xFFFFFFF0) on every rank that opened them; now every honest rank is
    refused (USMIPC_EBADHANDLE) and every rank, rank 1 included, raises
    ExchangeError naming rank 1's memory. Then the group still exchanges
    and reads every peer's memory."""
    from conftest import reseal  # tests/python: this script's directory

    me, n = eng.rank, eng.size
    cls = ud._TorchEngine if isinstance(eng, Torch) else ud._MPIEngine
    original = cls.allgather
    out["forged_slot"] = {}
    for slot in FORGED_SLOTS:
        if me == 1:
            def patched(self, obj, slot=slot):
                if isinstance(obj, dict):  # the record, not the outcome
                    forged = bytearray(obj["bundle"])
                    forged[24:28] = slot.to_bytes(4, "little")
                    obj = dict(obj, bundle=reseal(forged))
                return original(self, obj)
            cls.allgather = patched
        mem, _ = fresh_memory(me)
        try:
            eng.exchange(mem)
            raise AssertionError(f"slot {slot:#x}: the exchange succeeded")
        except ud.ExchangeError as e:
            # The ranks that failed are the honest ones, each refused rank
            # 1's bytes; rank 1 mapped its peers and raises alike.
            honest = set(range(n)) - {1}
            assert set(e.failures) == honest, (slot, e.failures)
            for r, why in e.failures.items():
                assert f"rank {r} could not map rank 1's memory" in why, why
                assert f"slot {slot} is beyond" in why, why
            assert "rank 1's memory" in str(e), str(e)
            if me == 1:
                assert e.__cause__ is None, e.__cause__
            else:
                cause = e.__cause__
                assert isinstance(cause, ValueError), repr(cause)
                assert cause.name == "USMIPC_EBADHANDLE", cause.name
            out["forged_slot"][str(slot)] = {
                "message": str(e),
                "failures": {str(r): m for r, m in e.failures.items()}}
        finally:
            cls.allgather = original
    mem, mine = fresh_memory(100 + me)
    with eng.exchange(mem) as ex:
        assert len(ex) == n
        out["after_forged"] = [
            int(mine[0]) if r == me else
            int(np.asarray(ex[r]).view(np.int64)[0]) for r in range(n)]
        eng.barrier()  # everyone has read before anyone closes


def main():
    engine, scenario, outdir = sys.argv[1:4]
    t0 = time.perf_counter()
    eng = Torch() if engine == "torch" else MPI()
    out = {"rank": eng.rank, "size": eng.size, "pid": os.getpid(),
           "boot_id": ud._boot_id(), "init_s": time.perf_counter() - t0}
    globals()[f"scenario_{scenario}"](eng, out)
    out["ok"] = True
    with open(os.path.join(outdir, f"rank{eng.rank}.json"), "w") as f:
        json.dump(out, f)
    if scenario.startswith("death"):
        # The group has a dead member: tearing it down may wait on it.
        sys.stdout.flush()
        os._exit(0)
    eng.finish()


if __name__ == "__main__":
    main()
