"""torch.multiprocessing's sharing of CUDA tensors, through usmipc.

Code that shares CUDA tensors by putting them on a ``torch.multiprocessing``
queue, or by calling ``ForkingPickler.dumps`` /
``torch.multiprocessing.reductions.reduce_tensor`` itself, gets usmipc's
sharing without a change::

    import usmipc.torch
    usmipc.torch.install()          # or USMIPC_TORCH=1 for every process

What ``install()`` changes (``uninstall()`` puts each back):

- torch's ``reduce_tensor`` and ``reduce_storage`` (the functions torch
  registers with ``ForkingPickler``) route CUDA tensors and storages, and
  CPU ones whose memory is usmipc's, to usmipc. The functions keep their
  identity (their code is swapped), so code that bound them by name before,
  and a later ``init_reductions()``, get the routed ones too. Everything
  else (CPU tensors of torch's allocator, meta, sparse and nested layouts'
  own handling) stays torch's.
- ``ForkingPickler.dumps`` pickles a message's CUDA storages as one usmipc
  bundle: one export per new allocation (none when repeated), one event and
  one release ticket per message, whatever the number of tensors.
- ``multiprocessing``'s ``Queue.put`` / ``JoinableQueue.put`` record an
  event on the putting thread's current CUDA stream, so that the message,
  pickled later in the queue's feeder thread, is ordered after the work the
  caller queued before ``put()`` (on that stream, whatever the feeder's).

The receiver rebuilds through ``usmipc.torch`` functions (importable: the
receiver needs usmipc, not ``install()``): its current stream waits for the
sender's work on the device; its storages are views of one mapping per
allocation; a storage that arrives again while the last one lives is that
storage. When the receiver's last tensor of a message dies, the message's
ticket goes back with an event recorded then on the receiver's current
stream; the sender keeps the storages (and so the caching allocator's
blocks) until every ticket of them came back and that work is done.
docs/torch.md says what differs from torch's own sharing.

This module imports torch; ``_usmipc_torch_hook`` (the ``.pth`` switch)
imports it only once the program imports ``torch.multiprocessing``.
"""

from __future__ import annotations

import json
import multiprocessing.queues
import copyreg
import functools
import io
import os
import pickle
import sys
import threading
import types
import warnings
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

from usmipc import _usmipc
from usmipc import memory as _memory

__all__ = ["install", "uninstall", "installed", "stats", "reset_stats"]

ENV_SWITCH = "USMIPC_TORCH"
ENV_STATS_DIR = "USMIPC_TORCH_STATS"

_lock = threading.RLock()


class _Local(threading.local):
    """Per thread: class attributes are the defaults, so a lookup never
    raises (getattr(local, name, default) costs an exception when unset)."""

    bypass = 0  # > 0: torch's own reductions (a message pickled again)
    messages: list = []  # the dumps calls running, innermost last
    opened: list = []  # the messages being loaded, innermost last


_tls = _Local()

# What install() replaced, to put back: torch's functions whose code was
# swapped (function -> its own code), and the attributes set on classes.
_swapped_code: dict = {}
_torch_reduce: dict = {}  # name -> a copy of torch's function, called as-is
_torch_fn: dict = {}  # name -> torch's function itself (its code swapped)
_saved_attrs: list = []  # (owner, name, value) in the order set

# ---- counters (stats(); USMIPC_TORCH_STATS writes them at exit) ----------

_COUNTERS = (
    "cuda_tensors",  # CUDA tensors the reducer saw
    "cuda_storages",  # CUDA storages the reducer saw (not through a tensor)
    "routed_tensors",  # ... that travel through usmipc (CUDA or host)
    "routed_storages",
    "host_tensors",  # CPU tensors over usmipc memory, routed
    "torch_tensors",  # tensors left to torch's own reduction
    "fallbacks",  # CUDA tensors usmipc refused, sent by torch's path instead
    "refused",  # CUDA tensors refused as torch refuses them (a non-leaf
    # that requires grad): never pickled
    "messages",  # ForkingPickler.dumps calls that carried routed memory
    "bundles",  # usmipc bundles made (one per message and device)
    "standalone",  # tensors pickled outside dumps (one bundle each)
    "forwarded",  # received bundles sent on (usmipc.forward_shared)
    "received_tensors",
    "received_storages",
    "reused_storages",  # arrivals that found their storage alive
)
_counts = dict.fromkeys(_COUNTERS, 0)


def stats() -> dict:
    """What the reducers did in this process (counts since install or
    ``reset_stats()``), with ``usmipc.stats()`` under ``"usmipc"``."""
    _usmipc._torch_fold_counts()  # what the C steps counted since
    out: dict[str, Any] = dict(_counts)
    out["usmipc"] = _usmipc.stats()
    return out


def reset_stats() -> None:
    """Sets the counters of ``stats()`` to zero (not usmipc.stats())."""
    _usmipc._torch_fold_counts()
    for k in _counts:
        _counts[k] = 0


def _write_stats(directory: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{os.getpid()}.json")
        # Whole or not at all: a process killed while writing (a pool's
        # worker terminated) leaves no half file.
        with open(path + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "argv": sys.argv, **stats()}, f)
        os.replace(path + ".tmp", path)
    except Exception as e:  # at exit: say so, never raise
        print(f"usmipc.torch: could not write {ENV_STATS_DIR}: {e}",
              file=sys.stderr)


class _StatsAtExit:
    """Writes stats() to USMIPC_TORCH_STATS/<pid>.json when the process
    ends: multiprocessing's finalizers run at the end of every process it
    starts (fork and forkserver children leave by os._exit, without atexit)
    and, through its own atexit hook, of the main process. A forked child
    starts its counts from zero and registers again."""

    def __init__(self, directory: str):
        import multiprocessing.util as util
        self.directory = directory
        self._util = util
        self._register()
        util.register_after_fork(self, _StatsAtExit._after_fork)

    def _register(self):
        self._util.Finalize(self, _write_stats, args=(self.directory,),
                            exitpriority=0)

    def _after_fork(self):
        reset_stats()
        self._register()


_stats_at_exit: Optional[_StatsAtExit] = None


# ---- devices ---------------------------------------------------------------


def _torch():
    return sys.modules["torch"]


# torch's objects the per-tensor paths read, as module globals: bound by
# _bind_torch at the first tensor reduced or rebuilt (a receiver may load
# its first message before it imports torch itself), not looked up through
# the torch module per tensor.
_strided = _Tensor = _empty = _UntypedStorage = None
_leaf_dtype_set: Optional[frozenset] = None  # see _LEAF_DTYPE_NAMES


def _bind_torch() -> None:
    global _strided, _Tensor, _empty, _UntypedStorage, _leaf_dtype_set
    torch = _torch()
    _leaf_dtype_set = frozenset(getattr(torch, n) for n in _LEAF_DTYPE_NAMES)
    _Tensor, _empty = torch.Tensor, torch.empty
    _UntypedStorage = torch.UntypedStorage
    _strided = torch.strided
    # The receiver's per-tensor step in C (torch_rebuild.c): these objects
    # and the Python that takes every case it does not.
    _usmipc._torch_rebuild_setup({
        "tls": _tls, "received": _received, "counts": _counts,
        "Tensor": _Tensor, "empty": _empty,
        "UntypedStorage": _UntypedStorage, "slow": _rebuild_slow,
        "prune": _prune_received, "prune_at": _RECEIVED_PRUNE})


_uuid_of_index: dict = {}
_index_of_uuid: Optional[dict] = None


def _device_uuid(index: int) -> str:
    """The CUDA device's UUID: what names it across processes that see
    different CUDA_VISIBLE_DEVICES."""
    u = _uuid_of_index.get(index)
    if u is None:
        u = str(_torch().cuda.get_device_properties(index).uuid)
        _uuid_of_index[index] = u
    return u


def _local_index(uuid: str) -> Optional[int]:
    """This process's index of the device the sender named, or None."""
    global _index_of_uuid
    if _index_of_uuid is None or uuid not in _index_of_uuid:
        cuda = _torch().cuda
        _index_of_uuid = {_device_uuid(i): i
                          for i in range(cuda.device_count())}
    return _index_of_uuid.get(uuid)


def _raw_stream(index: int) -> int:
    """The CUDA stream current on device index now, as the native handle
    (0: the legacy default stream). torch.cuda.current_stream() makes a
    Stream object in Python (2-4 us a call); usmipc takes the handle as it
    is, with the device the memory is on."""
    return _torch()._C._cuda_getCurrentRawStream(index)


_stream_getters: dict = {}


def _stream_getter(index: int):
    """The function the release ticket calls when the receiver's last
    tensor of a message dies: the current stream of that device then (one
    per device, made once)."""
    f = _stream_getters.get(index)
    if f is None:
        f = _stream_getters[index] = functools.partial(
            _torch()._C._cuda_getCurrentRawStream, index)
    return f


# ---- the sender's side -----------------------------------------------------


_last_host_check = (0, False)  # (ptr, verdict): torch reduces a CPU
# tensor's storage right after the tensor; one query serves both.


def _is_usmipc_host(ptr: int) -> bool:
    """Whether ptr is host memory of usmipc (a MemoryUSMDevice of
    'host:cpu', host_array(), or a mapping of another process's): such CPU
    tensors travel through usmipc, not through torch's fd copy into shared
    memory (which would also rebind the tensor to the copy)."""
    global _last_host_check
    last_ptr, verdict = _last_host_check
    if ptr == last_ptr:
        _last_host_check = (0, False)  # used once: the memory may change
        return verdict
    try:
        info = _usmipc._pointer_query(ptr)
    except Exception:
        verdict = False
    else:
        # Mappings of another process's usmipc memory too: torch's path
        # would move them into a shared-memory copy.
        verdict = not info["is_foreign"]
    _last_host_check = (ptr, verdict)
    return verdict


class _Group:
    """The storages of one message on one device: one bundle."""

    __slots__ = ("device", "views", "index_of")

    def __init__(self, device):
        self.device = device  # torch.device
        # The storages: share() exports each whole (a 1-D uint8 array of
        # its bytes) and the bundle keeps them until its tickets are back.
        self.views: list = []
        self.index_of: dict = {}  # (data_ptr, nbytes) -> index


class _Forward:
    """Received storages of one bundle, sent on: the bytes this process
    opened, handed on once per message with a ticket of their own."""

    __slots__ = ("device", "name", "raw")

    def __init__(self, device, name, raw):
        self.device = device  # torch.device, here
        self.name = name  # the device as the bundle's sender named it
        self.raw = raw


# What one ForkingPickler.dumps collects while torch's pickling of the
# object runs: the routed storages, grouped by device (.group_of: a CUDA
# device's index, -1 the host), and the received ones, grouped by the
# bundle they came in (.forward_of); .add(storage, nbytes, tensor=None) ->
# (group, index). In C (python/usmipc/_ext/torch_reduce.c), with the
# per-tensor step of a message's common case: _reduce_tensor's rules, made
# without the Python of this module per tensor.
_Message = _usmipc._TorchMessage


def _forward_add(msg, storage, origin) -> tuple[int, int]:
    """msg.add() of a storage this process received (origin: _origin's
    answer): the bundle it came in, handed on once per message."""
    name, raw, index = origin
    g = msg.forward_of.get(raw)
    if g is None:
        g = msg.forward_of[raw] = len(msg.groups)
        msg.groups.append(_Forward(storage.device, name, raw))
    return g, index


def _origin(storage):
    """(the sender's device name, the bundle bytes, the leaf index) of a
    storage this process received and still holds, else None: another
    process's memory, not this one's to export, is handed on instead."""
    got = _received.get(
        (storage.device.index, storage.data_ptr(), storage.nbytes()))
    if got is None or _torch().UntypedStorage._expired(got[0]):
        return None
    return got[1]


def _forward_group(fwd: _Forward, put_event):
    """The bytes that hand a received bundle on (a ticket of their own,
    usmipc.forward_shared). They carry the first sender's ordering, not
    this process's: the work queued here on the memory finishes first
    (the put's event, or this thread's current stream), on the host."""
    if fwd.device.type == "cuda":
        if put_event is not None and put_event[0] == fwd.device.index:
            put_event[1].synchronize()
        else:
            _torch().cuda.current_stream(fwd.device).synchronize()
    try:
        raw = _usmipc.forward_shared(fwd.raw)
    except _usmipc.Error as e:
        said = type(e)(
            f"usmipc.torch: sending on a tensor this process received: {e} "
            f"(or put a copy: tensor.clone())")
        said.code, said.name = e.code, e.name
        said.native_code = getattr(e, "native_code", 0)
        raise said from e
    _counts["forwarded"] += 1
    return None, raw


def _routes(storage) -> bool:
    kind = storage.device.type
    if kind == "cuda":
        return storage.nbytes() > 0
    return kind == "cpu" and _routes_host(storage)


def _routes_host(storage) -> bool:
    """Whether a CPU storage travels through usmipc (its memory is
    usmipc's)."""
    ptr = storage.data_ptr()
    return ptr != 0 and _is_usmipc_host(ptr)


def _order_stream(index: Optional[int], put_event):
    """The stream the event of a bundle of CUDA device index (None: the
    host) is recorded on: the putting thread's (through its event) for a
    Queue.put; None: this thread's current one (the caller passes its
    handle)."""
    if index is None or put_event is None:
        return None
    put_index, event = put_event
    if index != put_index:
        return None
    streams = _tls.__dict__.setdefault("order_streams", {})
    s = streams.get(index)
    if s is None:
        s = streams[index] = _torch().cuda.Stream(index)
    s.wait_event(event)  # on the device: no host wait
    return s


# dtypes a bundle carries and torch's DLPack import gives back as they are
# (torch's dtype objects, made at the first use: torch is imported then).
_LEAF_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64", "int8",
                     "int16", "int32", "int64", "uint8", "bool")


# Whole leaves: a storage that exactly one tensor of the message covers
# whole (a state dict's parameter, as a rule) travels as that tensor: its
# leaf in the receiver is the tensor itself, with its dtype and shape, and
# _rebuild_tensor hands it out as it is instead of making a tensor over the
# storage (torch.empty().set_(), 2.9 us on an H100) and keeping the
# storage's bookkeeping. The memory, and so the export and the ticket, are
# the same. The message records it (torch_reduce.c) where the tensor is
# whole: offset 0, contiguous, all of the storage's bytes, of a dtype in
# _LEAF_DTYPE_NAMES.


def _share_group(group: _Group, put_event, msg=None, k: int = -1):
    """One bundle of the group's storages and its bytes. The caller keeps
    the bundle (_memory._keep) once the whole message is made: the sender
    holds it until every ticket of it came back. A group of message msg
    (its index k) is made from what msg recorded of each storage when it
    was pickled (the C step has read every tensor once already)."""
    stream = None
    if group.device.type == "cuda":
        index = group.device.index
        stream = _order_stream(index, put_event)
        if stream is None:
            # What share() would ask torch for, without a Stream object.
            stream = _raw_stream(index)
    bundle = msg.share(k, stream) if msg is not None else None
    if bundle is None:  # the storages' bytes (no record says more)
        bundle = _usmipc.share(group.views, stream=stream, release=True)
    _counts["bundles"] += 1
    return bundle, bundle.to_bytes()


def _device_name(device) -> str:
    if device.type == "cuda":
        return _cuda_name(device.index)
    return "cpu"


_cuda_names: dict = {}  # index -> "cuda:<uuid>"


def _cuda_name(index: int) -> str:
    """The name a message gives CUDA device index: by its UUID, which
    names it across processes that see different CUDA_VISIBLE_DEVICES."""
    name = _cuda_names.get(index)
    if name is None:
        name = _cuda_names[index] = "cuda:" + _device_uuid(index)
    return name


def _refusal(e: BaseException) -> bool:
    """A refusal of the memory (sent instead by torch's own path, with a
    warning): not a failure of the exchange itself."""
    return isinstance(e, (_usmipc.MemoryKindError, _usmipc.ArgumentError)) \
        or getattr(e, "name", "") in ("USMIPC_ENOTSUP", "USMIPC_EUNKNOWNPTR",
                                      "USMIPC_ENODEV")


_warned: set = set()


def _warn_fallback(e: BaseException) -> None:
    key = getattr(e, "name", type(e).__name__)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(
        f"usmipc.torch: usmipc cannot share this CUDA memory ({e}); it "
        f"travels by torch's own CUDA IPC instead (further cases of "
        f"{key} are not reported)", RuntimeWarning, stacklevel=3)


class _Fallback(Exception):
    """Raised inside a message's pickling to start it again through torch's
    own reductions."""


def _refuse_non_leaf() -> None:
    """torch's refusal of a non-leaf tensor that requires grad, in torch's
    words (code and tests match them)."""
    raise RuntimeError(
        "Cowardly refusing to serialize non-leaf tensor which "
        "requires_grad, since autograd does not support crossing process "
        "boundaries.  If you just want to transfer the data, call "
        "detach() on the tensor before serializing (e.g., putting it on "
        "the queue).")


def _reduce_tensor(tensor):
    """torch's reduce_tensor, routed (its code is swapped for a call of
    this). Runs once per tensor pickled: every attribute is read once."""
    if _strided is None:
        _bind_torch()
    if (_tls.bypass or tensor.is_nested
            or tensor.layout is not _strided):
        # Sparse and nested layouts: torch splits them into strided
        # tensors, each reduced through this function again.
        _counts["torch_tensors"] += 1
        return _torch_reduce["reduce_tensor"](tensor)
    # tensor.is_cuda, not tensor.device.type: a str made per read, 0.35 us
    # of the 2-4 us this function took a tensor (2-vCPU VM).
    storage = tensor.untyped_storage()
    cuda = tensor.is_cuda
    if cuda:
        _counts["cuda_tensors"] += 1
    elif not tensor.is_cpu or not _routes_host(storage):
        _counts["torch_tensors"] += 1
        return _torch_reduce["reduce_tensor"](tensor)
    requires_grad = tensor.requires_grad
    if requires_grad and not tensor.is_leaf:
        if cuda:
            _counts["refused"] += 1
        _refuse_non_leaf()
    if tensor._backward_hooks:
        _torch().utils.hooks.warn_if_has_hooks(tensor)
    meta = (type(tensor), tuple(tensor.size()), tensor.stride(),
            tensor.storage_offset(), tensor.dtype, requires_grad)
    _counts["routed_tensors"] += 1
    if not cuda:
        _counts["host_tensors"] += 1
    nbytes = storage.nbytes()
    if nbytes == 0:
        return (_rebuild_empty, (_device_name(tensor.device),) + meta)
    messages = _tls.messages
    if messages:
        # Whole: may travel as itself if it is the storage's only tensor in
        # the message (whole leaves). Read here, where it costs least.
        whole = (meta[3] == 0 and tensor.nbytes == nbytes
                 and meta[4] in _leaf_dtype_set
                 and tensor.is_contiguous())
        return (_rebuild_tensor,
                (messages[-1].add(storage, nbytes,
                                  tensor if whole else None),) + meta)
    return _standalone(storage, tensor, meta)


def _standalone(storage, tensor, meta):
    """A tensor pickled outside ForkingPickler.dumps (a spawned Process's
    arguments, ForkingPickler(file).dump()): one bundle of its own, or
    the bundle it came in, handed on."""
    origin = _origin(storage) if _received else None
    if origin is not None:
        name, raw, index = origin
        _, raw = _forward_group(_Forward(storage.device, name, raw), None)
        return (_rebuild_forwarded, (raw, name, index) + meta)
    group = _Group(storage.device)
    group.views.append(storage)
    try:
        bundle, raw = _share_group(group, None)
    except _usmipc.Error as e:
        if not _refusal(e):
            raise
        _warn_fallback(e)
        _counts["fallbacks"] += 1
        _counts["routed_tensors"] -= 1
        return _torch_reduce["reduce_tensor"](tensor)
    _memory._keep(bundle)
    _counts["standalone"] += 1
    return (_rebuild_standalone,
            (raw, _device_name(storage.device)) + meta)


def _reduce_storage(storage):
    """torch's reduce_storage, routed: CUDA storages (which torch refuses
    to pickle) travel as usmipc memory too; typed storages come here
    through torch's reduce_typed_storage(_child), as their untyped one."""
    if _tls.bypass:
        return _torch_reduce["reduce_storage"](storage)
    kind = storage.device.type
    if kind == "cuda":
        _counts["cuda_storages"] += 1
    if kind == "cuda" and storage.nbytes() == 0:
        return (_rebuild_empty_storage, (_device_name(storage.device),))
    if not _routes(storage):
        return _torch_reduce["reduce_storage"](storage)
    _counts["routed_storages"] += 1
    messages = _tls.messages
    if messages:
        return (_rebuild_storage,
                (messages[-1].add(storage, storage.nbytes()),))
    origin = _origin(storage) if _received else None
    if origin is not None:
        name, raw, index = origin
        _, raw = _forward_group(_Forward(storage.device, name, raw), None)
        return (_rebuild_forwarded_storage, (raw, name, index))
    group = _Group(storage.device)
    group.views.append(storage)
    bundle, raw = _share_group(group, None)
    _memory._keep(bundle)
    _counts["standalone"] += 1
    return (_rebuild_standalone_storage, (raw, _device_name(storage.device)))


# ForkingPickler.dumps, and the message it makes.


class _Envelope:
    """What a message with routed memory is pickled as: the bundles' bytes,
    then torch's pickle of the object, loaded once they are open."""

    __slots__ = ("groups", "body")

    def __init__(self, groups, body):
        self.groups, self.body = groups, body

    def __reduce__(self):
        return (_open_message, (self.groups, self.body))


class _Tagged:
    """An object Queue.put() handed to the feeder thread with the event it
    recorded on the putting thread's stream."""

    __slots__ = ("obj", "put_event")

    def __init__(self, obj, put_event):
        self.obj, self.put_event = obj, put_event

    def __reduce__(self):  # pickled by something else than dumps: as is
        return (_untag, (self.obj,))


def _untag(obj):
    return obj


_torch_dumps = None  # ForkingPickler.dumps as it was (a classmethod)

# ForkingPickler's __init__ copies copyreg's dispatch table and adds its
# _extra_reducers (79 with torch imported) per dumps: 2.4 us of a one-tensor
# dumps of 24 here. _plain_dumps pickles with a class holding that merged
# table, made again whenever either source differs from the snapshot it
# was made of (compared in full: 0.8 us; a count would miss a replaced
# reducer).
_merged: tuple = (None, None, None)  # (pickler class, copyreg's, extra)


def _plain_dumps(cls, obj, protocol):
    """What ForkingPickler.dumps (torch's) returns for obj."""
    global _merged
    if cls is not ForkingPickler:  # a subclass may differ: its own dumps
        return _torch_dumps.__func__(cls, obj, protocol)
    pickler, base, extra = _merged
    if (pickler is None or extra != ForkingPickler._extra_reducers
            or base != copyreg.dispatch_table):
        base = dict(copyreg.dispatch_table)
        extra = dict(ForkingPickler._extra_reducers)
        table = dict(base)
        table.update(extra)
        # Tensors that torch's routed reduce_tensor reduces: the C step
        # (torch_reduce.c), which calls _reduce_tensor for all it does not
        # take (no trampoline either way).
        routed = _torch_fn.get("reduce_tensor")
        for t, fn in extra.items():
            if routed is not None and fn is routed:
                table[t] = _usmipc._torch_reduce_tensor
        # A ForkingPickler still (isinstance, and whatever else a Python
        # gives the class), whose __init__ leaves the table to the class.
        pickler = type("ForkingPickler", (ForkingPickler,),
                       {"dispatch_table": table,
                        "__init__": pickle.Pickler.__init__,
                        "__module__": __name__})
        _merged = (pickler, base, extra)  # one store: threads see either
    buf = io.BytesIO()
    pickler(buf, protocol).dump(obj)
    return buf.getbuffer()


class _Reduced:
    """An object pickled as the reduction given (the tensor it was made
    of, as torch's pickling of it would save it)."""

    __slots__ = ("red",)

    def __init__(self, red):
        self.red = red

    def __reduce__(self):
        return self.red


def _lone_body(cls, obj, protocol):
    """The body of a message that is one tensor (of a type ForkingPickler
    reduces by torch's reduce_tensor: Tensor, Parameter): its
    reduction, made here, pickled by the C pickler alone when it is
    usmipc's (strs, ints, tuples, torch's dtype and class), else by the
    merged pickler as torch's pickling of the tensor would. The same bytes
    as pickling the tensor, without the pickler's dispatch of it: 8 of the
    20 us of a one-tensor dumps (2-vCPU VM), more in a sender woken from a
    wait. None: not such a message."""
    fn = _torch_fn.get("reduce_tensor")
    if (cls is not ForkingPickler or fn is None or _tls.bypass
            or ForkingPickler._extra_reducers.get(type(obj)) is not fn):
        return None
    red = _reduce_tensor(obj)
    if red[0] is _rebuild_tensor or red[0] is _rebuild_empty:
        return pickle.dumps(_Reduced(red), protocol)
    return _plain_dumps(cls, _Reduced(red), protocol)


def _lone_message(t, put_event, protocol):
    """The message of one tensor t that travels through usmipc, whole
    (pickled, then loaded by _open_lone: one bundle of its one storage,
    without the _Message a message of many tensors collects, the body
    pickled apart and the envelope around it), or None where the general
    path must pickle it (a layout or memory torch keeps, no bytes, a
    tensor this process received, a refusal to say, hooks to warn of, a
    memory usmipc refuses). The repeated send of a weight-update loop:
    the Python of a one-tensor dumps, which the receiver's wait for the
    ticket's return makes run cold in a real loop, halved (issue 24). The
    caller checked that ForkingPickler reduces type(t) by torch's
    reduce_tensor as registered now."""
    if _strided is None:
        _bind_torch()
    if t.is_nested or t.layout is not _strided:
        return None
    storage = t.untyped_storage()
    cuda = t.is_cuda
    if not cuda and (not t.is_cpu or not _routes_host(storage)):
        return None
    nbytes = storage.nbytes()
    requires_grad = t.requires_grad
    if (nbytes == 0 or (requires_grad and not t.is_leaf)
            or t._backward_hooks
            or (_received and _origin(storage) is not None)):
        return None
    cls = type(t)
    dtype = t.dtype
    offset = t.storage_offset()
    if (offset == 0 and t.nbytes == nbytes and dtype in _leaf_dtype_set
            and t.is_contiguous()):
        view = t if cls is _Tensor else t.detach()  # whole leaves
    else:
        view = storage
    if cuda:
        index = t.get_device()
        stream = _order_stream(index, put_event)
        if stream is None:
            stream = _raw_stream(index)
        name = _cuda_name(index)
    else:
        stream, name = None, "cpu"
    try:
        bundle = _usmipc.share([view], stream=stream, release=True)
    except _usmipc.Error as e:
        if _refusal(e):  # the general path sends it by torch's, warned
            return None
        raise
    raw = bundle.to_bytes()
    _memory._keep(bundle)  # dropped once released and the work done
    counts = _counts
    counts["cuda_tensors" if cuda else "host_tensors"] += 1
    counts["routed_tensors"] += 1
    counts["bundles"] += 1
    counts["messages"] += 1
    # strs, ints, tuples and bytes: the C pickler without ForkingPickler's
    # per-instance copy of its dispatch table. The dtype by its name in
    # torch (what pickling it writes) and a plain Tensor's class as 0: a
    # global costs the pickler an import and a lookup, 0.8-1.1 us each of
    # the 2.9 us this pickling took (2-vCPU VM).
    dtype_name = _dtype_names.get(dtype)
    if dtype_name is None:
        dtype_name = _dtype_names[dtype] = dtype.__reduce__()
    return memoryview(pickle.dumps(_Reduced(
        (_open_lone, (name, raw, 0 if cls is _Tensor else cls,
                      tuple(t.size()), t.stride(), offset, dtype_name,
                      requires_grad))), protocol))


_dtype_names: dict = {}  # torch.dtype -> its name in torch ("float32")
_dtype_of_name: dict = {}  # and back, in a receiver


def _dumps(cls, obj, protocol=None):
    put_event = None
    if type(obj) is _Tagged:
        obj, put_event = obj.obj, obj.put_event
    routed = _torch_fn.get("reduce_tensor")
    if (cls is ForkingPickler and routed is not None and not _tls.bypass
            and ForkingPickler._extra_reducers.get(type(obj)) is routed):
        # In C for its common case (torch_reduce.c), else in Python.
        out = _usmipc._torch_lone(obj, put_event, protocol)
        if out is None:
            out = _lone_message(obj, put_event, protocol)
        if out is not None:
            return out
    plain = _plain_dumps
    messages = _tls.__dict__.setdefault("messages", [])  # this thread's
    msg = _Message(put_event)
    messages.append(msg)
    _usmipc._torch_push(msg)  # the C step's stack, beside this one
    try:
        body = _lone_body(cls, obj, protocol)
        if body is None:
            body = plain(cls, obj, protocol)
    finally:
        _usmipc._torch_pop()
        messages.pop()
    if not msg.groups:
        return body
    made: dict = {}  # group index -> (bundle or None, bytes)
    try:
        for k, g in enumerate(msg.groups):
            if type(g) is _Group:
                made[k] = _share_group(g, put_event, msg, k)
    except _usmipc.Error as e:
        # Received memory has no torch path to fall back on (another
        # process's memory): then the refusal stands.
        if not _refusal(e) or msg.forward_of:
            raise
        # Pickled again by torch's own reductions; a bundle already made
        # for another device of the message is dropped unsent (its ticket
        # was never handed to anyone).
        del made
        _warn_fallback(e)
        _counts["fallbacks"] += sum(len(g.views) for g in msg.groups
                                    if type(g) is _Group)
        _tls.bypass += 1
        _usmipc._torch_push(None)  # no message: torch's reductions
        try:
            return plain(cls, obj, protocol)
        finally:
            _usmipc._torch_pop()
            _tls.bypass -= 1
    # Forwarded last: a ticket minted for a message that is never sent
    # would keep the first sender's memory until it exits.
    for k, g in enumerate(msg.groups):
        if type(g) is _Forward:
            made[k] = _forward_group(g, put_event)
    groups = []
    for k, g in enumerate(msg.groups):
        bundle, raw = made[k]
        if bundle is None:  # handed on: the first sender keeps it
            groups.append((g.name, raw))
            continue
        _memory._keep(bundle)  # dropped once released and the work done
        groups.append((_device_name(g.device), raw))
    _counts["messages"] += 1
    # The envelope holds only strs and bytes: the C pickler without
    # ForkingPickler's per-instance copy of its dispatch table (3 us here).
    # A memoryview, as ForkingPickler.dumps returns (callers use its
    # methods: .tobytes(), .release()).
    return memoryview(pickle.dumps(_Envelope(groups, bytes(body)),
                                   protocol))


def _put_event():
    """An event on the putting thread's current stream (None when this
    process has not initialized CUDA: nothing to order)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return (torch.cuda.current_device(), event)


_SCALARS = (type(None), bool, int, float, str, bytes)


def _wrap_put(put):
    def put_ordered(self, obj, block=True, timeout=None):
        if type(obj) not in _SCALARS:
            e = _put_event()
            if e is not None:
                obj = _Tagged(obj, e)
        return put(self, obj, block, timeout)

    put_ordered.__name__ = put.__name__
    put_ordered.__qualname__ = put.__qualname__
    put_ordered.__doc__ = put.__doc__
    put_ordered.__wrapped__ = put  # type: ignore[attr-defined]
    return put_ordered


# ---- the receiver's side ---------------------------------------------------

# (device index, data_ptr, nbytes) -> (weak reference, origin): a storage
# that arrives again while the last one lives is that storage (as torch's
# shared_cache); origin, (sender's device name, bundle bytes, leaf index),
# hands it on (_origin). The weak reference is torch's own (the int that
# UntypedStorage._weak_ref() returns, what StorageWeakRef wraps), freed here
# when its entry is replaced or pruned: a StorageWeakRef object cost 1-2 us
# a storage in the receiver's profile (H100, run 49). The device index is
# None on the host (device.index; a tensor's get_device() says -1 there, a
# storage's None).
_received: dict = {}
_RECEIVED_PRUNE = 4096


class _Opened:
    """A message's bundles, opened: their leaves are tensors, one per
    storage (a uint8 tensor of its bytes, or the one tensor the sender sent
    whole: whole leaves)."""

    __slots__ = ("groups", "leaves", "storages")

    def __init__(self, groups, leaves):
        self.groups = groups  # (device name, bytes) per bundle
        self.leaves = leaves
        self.storages: dict = {}

    def storage(self, at: tuple[int, int]):
        s = self.storages.get(at)
        if s is None:
            g, i = at
            name, raw = self.groups[g]
            s = self.storages[at] = _storage_of(self.leaves[g][i],
                                                (name, raw, i))
        return s


def _storage_of(leaf, origin):
    """The storage of an opened leaf, or the live storage of the same
    memory this process received before. origin: (device name, bundle
    bytes, leaf index), which hand it on."""
    return _storage_or_live(leaf, origin)[0]


def _storage_or_live(leaf, origin):
    """(storage, fresh): the leaf's own storage (fresh), filed in _received
    under (device index or None, data_ptr, nbytes) with origin, or the live
    one of the same memory received before (not fresh), as _storage_of
    says. In C (torch_rebuild.c), which _rebuild_tensor calls directly."""
    if _UntypedStorage is None:
        _bind_torch()
    return _usmipc._torch_storage_or_live(leaf, origin)


def _prune_received() -> None:
    """Drops _received's entries of storages no longer alive (the C lookup
    calls it when the dict reaches _RECEIVED_PRUNE)."""
    storages = _UntypedStorage
    dead = [k for k, (ref, _) in _received.items() if storages._expired(ref)]
    for k in dead:
        storages._free_weak_ref(_received.pop(k)[0])


# A device as messages name it -> (pid, stream getter or None): what
# _open_group needs for it in this process, made once (the device's index
# here, torch.cuda.init(), the getter of its current stream's handle). The
# pid: a forked child makes it again, where torch.cuda.init() says what is
# wrong with CUDA after a fork.
_routes_in: dict = {}


def _route_in(device: str):
    getter = None
    if device.startswith("cuda:"):
        index = _local_index(device[5:])
        if index is None:
            raise _usmipc.Error(
                f"usmipc.torch: the sender's CUDA device {device[5:]} is not "
                f"visible in this process (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): "
                f"make it visible to receive its tensors")
        _torch().cuda.init()  # a bad fork's error, else a no-op once done
        getter = _stream_getter(index)
    route = _routes_in[device] = (os.getpid(), getter)
    return route


def _open_group(device: str, raw: bytes):
    route = _routes_in.get(device)
    if route is None or route[0] != os.getpid():
        route = _route_in(device)
    release = route[1]
    # The stream the open orders on: the device's current one now; the
    # release ticket's, the current one when the receiver drops the tensor.
    stream = release() if release is not None else None
    try:
        return _usmipc.open_shared(raw, stream=stream, to="torch",
                                   release_stream=release)
    except _usmipc.Error as e:
        if getattr(e, "name", "") != "USMIPC_EEXPORTERGONE":
            raise
        if "has exited" in str(e):  # src/bundle.c's check_live: gone
            said = type(e)(
                f"{e}. usmipc.torch: the sender is gone before this message "
                f"was loaded, and memory of PyTorch's default caching "
                f"allocator ends with its process: keep the sender alive "
                f"until its receivers have loaded what it sent, or allocate "
                f"what must outlive it as fd memory (PYTORCH_CUDA_ALLOC_CONF="
                f"expandable_segments:True, or usmipc.memory."
                f"use_torch_allocator())")
        else:  # alive, and it freed the message's bundle
            said = type(e)(
                f"{e}. usmipc.torch: the sender freed this message's tensors "
                f"once its receiver had loaded and dropped them: a message "
                f"of ForkingPickler.dumps is one handoff, loaded once; to "
                f"send the tensors again, the sender dumps it again (cheap "
                f"when they are the same tensors)")
        said.code, said.name = e.code, e.name
        said.native_code = getattr(e, "native_code", 0)
        raise said from e


def _open_message(groups, body):
    opened = _Opened(groups,
                     [_open_group(device, raw) for device, raw in groups])
    stack = _tls.__dict__.setdefault("opened", [])
    stack.append(opened)
    try:
        return ForkingPickler.loads(body)
    finally:
        stack.pop()


def _open_lone(device, raw, cls, size, stride, offset, dtype_name,
               requires_grad):
    """Loads a message of one tensor (_lone_message): its bundle opened,
    the tensor rebuilt as a message's tensor is. cls 0: torch.Tensor."""
    if _Tensor is None:
        # A receiver's first message may come before it imports torch
        # (this message names no torch global, which would import it).
        import torch  # noqa: F401
        _bind_torch()
    if cls == 0:
        cls = _Tensor
    dtype = _dtype_of_name.get(dtype_name)
    if dtype is None:
        dtype = getattr(_torch(), dtype_name, None)
        if not isinstance(dtype, _torch().dtype):
            raise _usmipc.Error(
                f"usmipc.torch: a message names the dtype {dtype_name!r}, "
                f"which this process's torch {_torch().__version__} does "
                f"not have: sender and receiver must run the same torch")
        _dtype_of_name[dtype_name] = dtype
    leaf = _open_group(device, raw)[0]
    if (cls is _Tensor and not requires_grad and offset == 0
            and leaf.dtype is dtype and leaf.shape == size
            and leaf.stride() == stride):
        # The common case, as _rebuild_tensor takes it, without a message's
        # bookkeeping (one tensor: nothing in it to share a storage with):
        # the sender's whole tensor is the leaf itself, unless this process
        # still holds that storage, which the tensor is then made over.
        storage, fresh = _storage_or_live(leaf, (device, raw, 0))
        _counts["received_tensors"] += 1
        if fresh:
            return leaf
        return _empty(0, dtype=dtype, device=storage.device).set_(
            storage, offset, size, stride)
    stack = _tls.__dict__.setdefault("opened", [])
    stack.append(_Opened(((device, raw),), ((leaf,),)))
    try:
        return _rebuild_tensor((0, 0), cls, size, stride, offset, dtype,
                               requires_grad)
    finally:
        stack.pop()


def _tensor_on(storage, cls, size, stride, offset, dtype, requires_grad):
    """torch's _rebuild_tensor and rebuild_tensor's Parameter rule."""
    torch = _torch()
    _counts["received_tensors"] += 1
    t = torch.empty(0, dtype=dtype, device=storage.device).set_(
        storage, offset, size, stride)
    if cls is not torch.Tensor and cls is torch.nn.parameter.Parameter:
        # Integer parameters need requires_grad=False in the constructor.
        return torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad = True
    return t


def _current_opened() -> _Opened:
    stack = _tls.opened
    if not stack:
        raise _usmipc.Error(
            "usmipc.torch: a routed tensor outside its message (these bytes "
            "are part of what ForkingPickler.dumps made: load all of them "
            "with ForkingPickler.loads)")
    return stack[-1]


def _rebuild_slow(at, cls, size, stride, offset, dtype, requires_grad):
    """Rebuilds a tensor of a message (ForkingPickler.dumps); at is its
    storage's (bundle, array) in the message. Every case: _rebuild_tensor
    (torch_rebuild.c) runs the common ones (a plain tensor, the sender's
    whole tensor or a view of a storage made already) and calls this for
    the rest."""
    if _empty is None:
        _bind_torch()
    stack = _tls.opened
    opened = stack[-1] if stack else _current_opened()  # that one raises
    storage = opened.storages.get(at)
    if storage is None:
        g, i = at
        leaf = opened.leaves[g][i]
        if (leaf.dtype is dtype and offset == 0 and leaf.shape == size
                and leaf.stride() == stride):
            # The sender's tensor itself (whole leaves): handed out as it
            # is, unless this process still holds that storage (then the
            # tensor is made over that storage, as torch does).
            name, raw = opened.groups[g]
            storage, fresh = _storage_or_live(leaf, (name, raw, i))
            opened.storages[at] = storage
            if fresh:
                _counts["received_tensors"] += 1
                if cls is not _Tensor and cls is _torch().nn.Parameter:
                    return _torch().nn.Parameter(
                        leaf, requires_grad=requires_grad)
                if requires_grad:
                    leaf.requires_grad = True
                return leaf
        storage = opened.storage(at)
    if cls is not _Tensor or requires_grad:
        return _tensor_on(storage, cls, size, stride, offset, dtype,
                          requires_grad)
    _counts["received_tensors"] += 1
    return _empty(0, dtype=dtype, device=storage.device).set_(
        storage, offset, size, stride)


# What messages name for each tensor: the common case in C, the rest by
# _rebuild_slow (a builtin pickles by its own name, usmipc._usmipc's
# _torch_rebuild; it binds torch itself at a receiver's first tensor).
_rebuild_tensor = _usmipc._torch_rebuild


def _rebuild_storage(at):
    """Rebuilds a storage of a message."""
    _counts["received_storages"] += 1
    return _current_opened().storage(at)


def _rebuild_standalone(raw, device, cls, size, stride, offset, dtype,
                        requires_grad):
    """Rebuilds a tensor pickled on its own (one bundle)."""
    storage = _storage_of(_open_group(device, raw)[0], (device, raw, 0))
    return _tensor_on(storage, cls, size, stride, offset, dtype,
                      requires_grad)


def _rebuild_standalone_storage(raw, device):
    _counts["received_storages"] += 1
    return _storage_of(_open_group(device, raw)[0], (device, raw, 0))


def _rebuild_forwarded(raw, device, index, cls, size, stride, offset, dtype,
                       requires_grad):
    """Rebuilds a tensor pickled on its own that its sender had received:
    leaf index of the bundle it came in, handed on."""
    storage = _storage_of(_open_group(device, raw)[index], (device, raw, index))
    return _tensor_on(storage, cls, size, stride, offset, dtype,
                      requires_grad)


def _rebuild_forwarded_storage(raw, device, index):
    _counts["received_storages"] += 1
    return _storage_of(_open_group(device, raw)[index], (device, raw, index))


def _local_device(device: str):
    torch = _torch()
    if device.startswith("cuda:"):
        index = _local_index(device[5:])
        return torch.device("cuda", index if index is not None else
                            torch.cuda.current_device())
    return torch.device(device)


def _rebuild_empty(device, cls, size, stride, offset, dtype, requires_grad):
    """A tensor of no bytes: nothing to map."""
    torch = _torch()
    storage = torch.UntypedStorage(0, device=_local_device(device))
    return _tensor_on(storage, cls, size, stride, offset, dtype,
                      requires_grad)


def _rebuild_empty_storage(device):
    return _torch().UntypedStorage(0, device=_local_device(device))


# ---- install / uninstall ---------------------------------------------------

_ROUTED = {"reduce_tensor": _reduce_tensor, "reduce_storage": _reduce_storage}


def _trampoline(name: str) -> types.CodeType:
    """The code torch's function gets: a call of usmipc's, looked up in
    the module's globals (set by install, removed by uninstall)."""
    src = f"def {name}(arg):\n    return __usmipc_{name}(arg)\n"
    scope: dict = {}
    exec(compile(src, f"<usmipc.torch: {name}>", "exec"), scope)
    return scope[name].__code__


def installed() -> bool:
    """Whether install() is in effect."""
    return bool(_swapped_code)


def install() -> None:
    """Routes torch.multiprocessing's CUDA tensors and storages through
    usmipc for this process (see the module's documentation). Idempotent;
    thread-safe. Imports torch."""
    global _torch_dumps
    with _lock:
        if _swapped_code:
            return
        import torch.multiprocessing.reductions as reductions
        import multiprocessing.queues as queues

        for name, routed in _ROUTED.items():
            fn = getattr(reductions, name)
            code = fn.__code__
            if code.co_argcount != 1 or code.co_freevars:
                raise _usmipc.Error(
                    f"usmipc.torch: torch.multiprocessing.reductions.{name} "
                    f"of torch {_torch().__version__} is not the one-argument "
                    f"function usmipc routes; usmipc.torch does not "
                    f"support this torch")
            copy = types.FunctionType(code, fn.__globals__, name,
                                      fn.__defaults__, fn.__closure__)
            _torch_reduce[name] = copy
            _torch_fn[name] = fn
            fn.__globals__["__usmipc_" + name] = routed
            fn.__code__ = _trampoline(name)
            _swapped_code[fn] = code
        _bind_torch()
        _usmipc._torch_setup({
            "Group": _Group, "forward_add": _forward_add, "origin": _origin,
            "received": _received, "counts": _counts,
            "rebuild": _rebuild_tensor, "fallback": _reduce_tensor,
            "strided": _strided, "leaf_dtypes": _leaf_dtype_set,
            "Tensor": _Tensor,
            "raw_stream": getattr(_torch()._C, "_cuda_getCurrentRawStream",
                                  None),
            "order_stream": _order_stream, "cuda_names": _cuda_names,
            "cuda_name": _cuda_name, "dtype_names": _dtype_names,
            "keep": _memory._keep, "refusal": _refusal})
        _torch_dumps = ForkingPickler.__dict__["dumps"]
        _set(ForkingPickler, "dumps", classmethod(_dumps))
        for cls in (queues.Queue, queues.JoinableQueue):
            _set(cls, "put", _wrap_put(cls.__dict__["put"]))
        global _stats_at_exit
        directory = os.environ.get(ENV_STATS_DIR)
        if directory and _stats_at_exit is None:
            _stats_at_exit = _StatsAtExit(directory)


def _set(owner, name, value) -> None:
    _saved_attrs.append((owner, name, owner.__dict__[name]))
    setattr(owner, name, value)


def uninstall() -> None:
    """Puts torch's reductions, ForkingPickler.dumps and Queue.put back.
    Tensors already sent stay valid (their bundles are kept until
    released); messages pickled while installed still load."""
    with _lock:
        for fn, code in _swapped_code.items():
            fn.__code__ = code
            fn.__globals__.pop("__usmipc_" + fn.__name__, None)
        _swapped_code.clear()
        _torch_reduce.clear()
        _torch_fn.clear()
        while _saved_attrs:
            owner, name, value = _saved_attrs.pop()
            setattr(owner, name, value)
