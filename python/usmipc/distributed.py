"""Node-local sharing for distributed jobs (docs/distributed.md).

Ranks of a ``torch.distributed`` group or an MPI communicator that run on
one node map each other's buffers directly::

    import usmipc.distributed

    with usmipc.distributed.exchange(buf) as peers:   # every rank of the group
        other = torch.from_dlpack(peers[(rank + 1) % world])   # zero copy
        ...
    # leaving the block closes every mapping, then waits for the whole group

``exchange(mem, group=None)`` runs over ``torch.distributed``,
``exchange_mpi(mem, comm)`` over mpi4py. Every rank passes its own memory
(usmipc memory, a torch tensor, any array usmipc.share() takes) and gets an
``Exchange``: one entry per rank of the group, its own memory for itself, a
mapping on its own device for each rank of its node, and ``None`` for ranks
elsewhere, whose reason is in ``Exchange.reasons``. Handles travel with the
engine's own collectives; torch and mpi4py are imported only by the call
that uses them.

The exchange is built on ``usmipc.share()`` and ``usmipc.open_shared()``
(a peer's entry is a ``usmipc.SharedArray`` with the peer's shape, dtype
and strides) and is collective all the way: it succeeds on every rank or
raises on every rank (``ExchangeError`` names each failure), and
``close()`` unmaps, then waits for the group, before a rank lets go of its
own memory, so no rank frees memory a peer still maps.
"""

import os
import socket
import threading
import warnings
from collections.abc import Sequence
from typing import Any, Optional, Union, overload

import usmipc

__all__ = ["Exchange", "ExchangeError", "exchange", "exchange_mpi"]

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

# Own memory that must outlive its Exchange: an exchange dropped without
# close(), or whose collective close failed (a rank died, the engine timed
# out), cannot know that its peers stopped mapping the memory, so it keeps
# the memory until the process exits. (fd memory would survive its free in
# the importers; native CUDA memory is undefined there, cuda.h.)
_kept: list[tuple[Any, Any]] = []
_kept_lock = threading.Lock()

DeviceLike = Union["usmipc.Device", str, None]


def _keep_forever(bundle: Any, mem: Any) -> None:
    with _kept_lock:
        _kept.append((bundle, mem))


class ExchangeError(usmipc.Error):
    """An exchange (or its close) failed on one or more ranks.

    Every rank of the group raises it alike, so that none is left waiting in
    a collective: ``failures`` maps each failing rank to what went wrong
    there. A rank whose own step failed raises it with that exception as
    ``__cause__``.
    """

    def __init__(self, message: str,
                 failures: Optional[dict[int, str]] = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


def _boot_id() -> str:
    """This kernel's boot id: the identity usmipc's handles carry (a handle
    of another boot id is refused with USMIPC_EOTHERHOST), or '' where
    /proc does not say."""
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


# DLPack device types (dlpack.h): the device an array lives on.
_DL_CPU, _DL_CUDA, _DL_CUDA_MANAGED, _DL_ONEAPI = 1, 2, 13, 14


def _target_device(mem: Any, device: DeviceLike) -> "usmipc.Device":
    """The device this rank maps its peers' memory on: device= if given,
    else the device of its own memory."""
    if device is not None:
        return device if isinstance(device, usmipc.Device) \
            else usmipc.Device(device)
    own = getattr(mem, "device", None)
    if isinstance(own, usmipc.Device):  # usmipc memory, a SharedArray
        return own
    where = getattr(mem, "__dlpack_device__", None)
    if where is None:
        raise TypeError(
            f"exchange(): cannot tell which device a {type(mem).__name__} "
            "lives on (it is not usmipc memory and has no "
            "__dlpack_device__); pass device=")
    kind, index = where()
    if kind == _DL_CPU:
        return usmipc.Device("host:cpu")
    if kind in (_DL_CUDA, _DL_CUDA_MANAGED):
        return usmipc.Device(f"cuda:gpu:{index}")
    if kind == _DL_ONEAPI:
        return usmipc.Device(f"level_zero:gpu:{index}")
    raise TypeError(
        f"exchange(): a {type(mem).__name__} on DLPack device type {kind} "
        "is not memory usmipc shares; pass usmipc memory or a GPU array")


class Exchange(Sequence[Any]):
    """The buffers of every rank of a group, as this rank sees them.

    ``ex[r]`` is rank r's buffer: this rank's own memory for ``ex.rank``, a
    ``usmipc.SharedArray`` mapping of rank r's memory on this rank's device
    for the other ranks of its node (``torch.from_dlpack(ex[r])``,
    ``numpy.asarray(ex[r])`` on host memory: no copy, writes are seen by
    rank r), and ``None`` for ranks on other nodes, with the reason in
    ``ex.reasons[r]``. ``len(ex)`` is the group's size; ``ex.local_ranks``
    the ranks of this node, this one included.

    ``close()`` (or leaving a ``with`` block) is collective: every rank of
    the group must call it. It closes this rank's mappings, waits for every
    rank to have done the same, then lets go of this rank's own memory. A
    DLPack tensor or buffer view taken of a mapping keeps that mapping until
    it dies: drop them before closing.
    """

    def __init__(self, engine: "_Engine", entries: list[Any],
                 reasons: dict[int, str], local_ranks: tuple[int, ...],
                 bundle: Any, mem: Any, device: "usmipc.Device") -> None:
        self._engine = engine
        self._entries = entries
        self._device = device
        self._event: Optional["usmipc.Event"] = None
        self._bundle = bundle
        self._mem = mem
        self._closed = False
        self.rank = engine.rank
        self.reasons = reasons
        self.local_ranks = local_ranks

    def __len__(self) -> int:
        return len(self._entries)

    @overload
    def __getitem__(self, rank: int) -> Any: ...

    @overload
    def __getitem__(self, rank: slice) -> list[Any]: ...

    def __getitem__(self, rank: Union[int, slice]) -> Any:
        if self._closed:
            raise ValueError("the exchange is closed")
        return self._entries[rank]

    @property
    def closed(self) -> bool:
        """True once close() has run on this rank."""
        return self._closed

    def close(self) -> None:
        """Closes every mapping of this exchange on this rank, waits for
        every rank of the group to do the same (collective: each rank calls
        it), then releases this rank's own memory. Idempotent. If the wait
        fails (a rank died, the engine's timeout passed) the engine's error
        is raised as ExchangeError and this rank's memory is kept until the
        process exits, since a peer may still map it."""
        if self._closed:
            return
        self._closed = True
        for r, entry in enumerate(self._entries):
            if r != self.rank and entry is not None:
                entry.close()
        entries, self._entries = self._entries, [None] * len(self._entries)
        del entries
        bundle, mem = self._bundle, self._mem
        self._bundle = self._mem = None
        try:
            self._engine.barrier()
        except Exception as exc:
            _keep_forever(bundle, mem)
            raise ExchangeError(
                f"rank {self.rank}: close() could not wait for the other "
                f"ranks ({self._engine.name}: {exc}); this rank's memory is "
                "kept until the process exits, since a peer may still map "
                "it", {self.rank: str(exc)}) from exc

    def barrier(self, stream: Any = None) -> None:
        """A barrier of the group that the device keeps (collective).

        With a ``stream`` (a ``torch.cuda.Stream``, CuPy stream,
        ``usmipc.Queue`` or CUstream): work this rank submits to ``stream``
        after the call runs after the work every rank of its node submitted
        to its own stream before its call, and the host waits for no GPU
        work: each rank records an interprocess event on its stream, the
        event handles travel in one all-gather of the engine, and each rank
        makes its stream wait for its node's peers' events. Without a stream
        the same, on the device's default queue, and the host then waits for
        the peers' events (the host barrier a caller would otherwise write
        after synchronising its own device)."""
        if self._closed:
            raise ValueError("the exchange is closed")
        if self._event is None:
            self._event = usmipc.Event(self._device)
        self._event.record(stream)
        raws = self._engine.allgather(
            usmipc.IPCEventHandle(self._event).to_bytes())
        for r in self.local_ranks:
            if r == self.rank:
                continue
            peer = usmipc.IPCEventHandle.open(raws[r], self._device)
            if stream is None:
                peer.synchronize()
            else:
                peer.wait(stream)

    def __enter__(self) -> "Exchange":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        # No collective is possible here: unmap (the mappings would close
        # when collected anyway) and keep the memory peers may still map.
        self._closed = True
        _keep_forever(self._bundle, self._mem)
        warnings.warn(
            "usmipc.distributed.Exchange dropped without close(): its "
            "memory is kept until the process exits, since other ranks may "
            "still map it; call close() on every rank (or use 'with')",
            ResourceWarning, stacklevel=2)

    def __repr__(self) -> str:
        state = "closed" if self._closed else \
            f"{len(self.local_ranks)} on this node"
        return (f"<usmipc.distributed.Exchange rank {self.rank} of "
                f"{len(self._entries)}, {state}>")


def _run(engine: "_Engine", mem: Any, device: DeviceLike,
         ordered: Optional[bool]) -> Exchange:
    """The exchange itself, over any engine (_Engine: rank, size, name,
    allgather, barrier, apart)."""
    me = engine.rank
    bundle = raw = target = failure = None
    try:
        target = _target_device(mem, device)
        bundle = usmipc.share(mem, ordered=ordered)
        raw = bundle.to_bytes()
    except Exception as exc:
        failure = exc
    record = {"boot": _boot_id(), "host": socket.gethostname(),
              "pid": os.getpid(), "bundle": raw,
              "error": None if failure is None
              else f"{type(failure).__name__}: {failure}"}
    try:
        records = engine.allgather(record)
    except Exception:
        if bundle is not None:  # a peer that got our bytes may map them
            _keep_forever(bundle, mem)
        raise
    # Peers' records are checked before any field is used: a rank that sends
    # something else fails the exchange alike on every rank, named.
    failures = {}
    for r, rec in enumerate(records):
        why = _record_problem(rec)
        if why is not None:
            failures[r] = (f"rank {r} sent a malformed exchange record "
                           f"({why}); every rank must run the same "
                           "usmipc.distributed")
        elif rec["error"] is not None:
            failures[r] = (f"rank {r} could not share its memory: "
                           f"{rec['error']}")
    if failures:  # nothing is mapped yet: every rank raises
        raise ExchangeError(_summary(failures), failures) from failure

    assert target is not None  # no failure: _target_device returned
    apart = engine.apart(records)
    local = tuple(r for r in range(engine.size) if r not in apart)
    entries = [None] * engine.size
    entries[me] = mem
    error = None
    for r in local:
        if r == me:
            continue
        try:
            entries[r] = usmipc.open_shared(records[r]["bundle"],
                                            device=target)
        except Exception as exc:
            failure = exc
            error = (f"rank {me} could not map rank {r}'s memory on "
                     f"{target.filter_string}: {type(exc).__name__}: {exc}")
            break
    # Everyone has mapped (or failed) before anyone lets go of its memory.
    try:
        errors = engine.allgather(error)
    except Exception:
        _close_mapped(entries, me)
        _keep_forever(bundle, mem)
        raise
    failures = {r: e if isinstance(e, str) else
                (f"rank {r} sent a malformed error report (a "
                 f"{type(e).__name__}, not a string or None); every rank "
                 "must run the same usmipc.distributed")
                for r, e in enumerate(errors) if e is not None}
    if failures:
        _close_mapped(entries, me)
        try:
            engine.barrier()  # every rank has unmapped
        except Exception:
            _keep_forever(bundle, mem)
            raise
        raise ExchangeError(_summary(failures), failures) from failure
    return Exchange(engine, entries, apart, local, bundle, mem, target)


# What each rank's record holds: its key, the types its value may have.
_RECORD_FIELDS = (("boot", (str,)), ("host", (str,)), ("pid", (int,)),
                  ("bundle", (bytes, type(None))),
                  ("error", (str, type(None))))


def _record_problem(rec: Any) -> Optional[str]:
    """What is wrong with a peer's record (a clause), or None."""
    if not isinstance(rec, dict):
        return f"a {type(rec).__name__}, not a dict"
    for key, types in _RECORD_FIELDS:
        if key not in rec:
            return f"no {key!r} key"
        value = rec[key]
        # bool is an int to isinstance; a pid is not a bool
        if not isinstance(value, types) or isinstance(value, bool):
            allowed = " or ".join(t.__name__ for t in types)
            return (f"{key!r} is a {type(value).__name__}, not "
                    f"{allowed}")
    if rec["bundle"] is None and rec["error"] is None:
        return "neither a bundle nor an error"
    return None


def _close_mapped(entries: list[Any], me: int) -> None:
    for r, entry in enumerate(entries):
        if r != me and entry is not None:
            entry.close()


def _summary(failures: dict[int, str]) -> str:
    first = failures[min(failures)]
    more = len(failures) - 1
    return (f"usmipc.distributed: the exchange failed on {len(failures)} "
            f"rank(s): {first}" + (f" (and {more} more: see .failures)"
                                   if more else ""))


def _apart_by_boot_id(records: list[dict[str, Any]],
                      me: int) -> dict[int, str]:
    """Ranks on another node than rank me, judged by boot id (the running
    kernel: what the library itself checks), with their reasons."""
    mine = records[me]
    apart = {}
    for r, rec in enumerate(records):
        if rec["boot"] == mine["boot"] and (rec["boot"] or
                                            rec["host"] == mine["host"]):
            continue  # no boot id on either side: the host name decides
        apart[r] = (
            f"rank {r} runs on another node (host {rec['host']!r}, boot id "
            f"{rec['boot'] or 'unknown'}; this rank: host {mine['host']!r}, "
            f"boot id {mine['boot'] or 'unknown'}): usmipc maps memory only "
            "between processes of one running kernel")
    return apart


class _Engine:
    """What an exchange needs of a distributed engine."""
    name: str
    rank: int
    size: int

    def allgather(self, obj: Any) -> list[Any]:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def apart(self, records: list[dict[str, Any]]) -> dict[int, str]:
        """The ranks on another node than this one, with the reasons
        (collective: every rank calls it with the same records)."""
        raise NotImplementedError


class _TorchEngine(_Engine):
    name = "torch.distributed"

    def __init__(self, group: Any) -> None:
        try:
            import torch.distributed as dist
        except ImportError as exc:
            raise RuntimeError(
                "usmipc.distributed.exchange() needs torch.distributed "
                f"(import failed: {exc}); use exchange_mpi() with mpi4py "
                "otherwise") from exc
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "usmipc.distributed.exchange(): torch.distributed is not "
                "initialized; call torch.distributed.init_process_group() "
                "on every rank first")
        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(
                "usmipc.distributed.exchange(): this process is not a member "
                "of the group it was given")
        self.size = dist.get_world_size(group)

    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def barrier(self) -> None:
        # An object gather rather than dist.barrier(): it moves through the
        # same path as the exchange (NCCL: the current CUDA device), where
        # barrier() guesses a device when none was bound.
        self.allgather(None)

    def apart(self, records: list[dict[str, Any]]) -> dict[int, str]:
        return _apart_by_boot_id(records, self.rank)


class _MPIEngine(_Engine):
    name = "MPI"

    def __init__(self, comm: Any) -> None:
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise RuntimeError(
                "usmipc.distributed.exchange_mpi() needs mpi4py (import "
                f"failed: {exc})") from exc
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Comm):
            raise TypeError(
                "usmipc.distributed.exchange_mpi(): comm must be an mpi4py "
                f"communicator (MPI.Comm), not {type(comm).__name__}")
        if comm == MPI.COMM_NULL:
            raise ValueError(
                "usmipc.distributed.exchange_mpi(): comm is MPI.COMM_NULL")
        if comm.Is_inter():
            raise ValueError(
                "usmipc.distributed.exchange_mpi(): comm is an "
                "intercommunicator; pass an intracommunicator (merge it "
                "with Merge())")
        self._MPI = MPI
        self._comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def allgather(self, obj: Any) -> list[Any]:
        return list(self._comm.allgather(obj))

    def barrier(self) -> None:
        self._comm.Barrier()

    def apart(self, records: list[dict[str, Any]]) -> dict[int, str]:
        # MPI decides the node (the shared-memory split); the boot id must
        # agree too, since the library refuses handles of another kernel
        # (a container or VM that MPI takes for this node, or a simulated
        # second node: tests/python/test_distributed.py).
        node = self._comm.Split_type(self._MPI.COMM_TYPE_SHARED,
                                     key=self.rank)
        try:
            on_node = set(node.allgather(self.rank))
        finally:
            node.Free()
        mine = records[self.rank]
        apart = {}
        for r, rec in enumerate(records):
            if r not in on_node:
                apart[r] = (
                    f"rank {r} is on another node by MPI's "
                    f"COMM_TYPE_SHARED split (host {rec['host']!r}, boot id "
                    f"{rec['boot'] or 'unknown'}; this rank: host "
                    f"{mine['host']!r}, boot id {mine['boot'] or 'unknown'})")
            elif rec["boot"] != mine["boot"]:
                apart[r] = (
                    f"MPI puts rank {r} (host {rec['host']!r}) on this node "
                    "(COMM_TYPE_SHARED), but its kernel's boot id "
                    f"{rec['boot'] or 'unknown'} differs from this rank's "
                    f"({mine['boot'] or 'unknown'}): usmipc maps memory only "
                    "between processes of one running kernel")
        return apart


def exchange(mem: Any, group: Any = None, *, device: DeviceLike = None,
             ordered: Optional[bool] = None) -> Exchange:
    """Maps the buffers of the other ranks of a torch.distributed group
    that share this rank's node. Collective: every rank of ``group``
    (default: the whole job) calls it with its own memory.

    ``mem`` is usmipc memory, a torch tensor (on a GPU, or a CPU tensor
    viewing usmipc host memory), or any array ``usmipc.share()`` takes.
    Returns an ``Exchange``: ``ex[r]`` is this rank's ``mem`` for itself, a
    ``usmipc.SharedArray`` mapping of rank r's memory on ``device`` (default:
    the device of ``mem``) for ranks of this node, ``None`` with
    ``ex.reasons[r]`` for ranks elsewhere. The node is the running kernel
    (its boot id), gathered with the handles in one ``all_gather_object``;
    a GPU of another rank that ``CUDA_VISIBLE_DEVICES`` hides is mapped
    through peer access where the driver allows (docs/distributed.md).

    ``ordered`` as for ``usmipc.share()``: by default the mappings are made
    after the work each rank queued on its memory before the call. The call
    succeeds everywhere or raises ``ExchangeError`` everywhere; a rank that
    never arrives makes the others fail with the engine's own timeout
    (``init_process_group(timeout=...)``). Close the result on every rank
    (``close()`` or ``with``).
    """
    return _run(_TorchEngine(group), mem, device, ordered)


def exchange_mpi(mem: Any, comm: Any = None, *, device: DeviceLike = None,
                 ordered: Optional[bool] = None) -> Exchange:
    """``exchange()`` over an mpi4py communicator (default
    ``MPI.COMM_WORLD``): collective over ``comm``. The node is MPI's
    (``comm.Split_type(MPI.COMM_TYPE_SHARED)``), narrowed to the ranks of
    this rank's kernel (boot id); handles travel with ``comm.allgather`` and
    ``close()`` ends with ``comm.Barrier()``. Everything else as for
    ``exchange()``."""
    return _run(_MPIEngine(comm), mem, device, ordered)
