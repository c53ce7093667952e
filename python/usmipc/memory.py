"""Memory allocated by usmipc, and its sharing between processes.

``MemoryUSMDevice``, ``MemoryUSMHost`` and ``MemoryUSMShared`` allocate USM
memory of the three kinds; ``IPCMemoryHandle`` exports device memory and maps
it in another process as a ``MemoryIPCDevice``; ``MemoryPool`` hands out
blocks that share at the cost of one export per segment; its bytes are ordered by
default (importers wait for the producer's work before the handoff).
``IPCEventHandle`` (also ``usmipc.IPCEventHandle``) shares a ``usmipc.Event``
the same way. All are C types from ``usmipc._usmipc``; this module only
gathers them (dpctl's ``dpctl.memory`` layout), and adds
``use_torch_allocator()``, which makes every CUDA tensor of the process a
pool block (torch is imported only by the torch functions).
"""

import atexit
import copyreg
import ctypes
import os
import threading
import time
import warnings
from typing import Any  # noqa: F401  (host_array's annotations)
from multiprocessing.reduction import ForkingPickler

from usmipc import _usmipc
from usmipc._usmipc import (
    USMIPC_EINVAL,
    ArgumentError,
    ArgumentTypeError,
    Device,
    IPCEventHandle,
    IPCMemoryHandle,
    MemoryIPCDevice,
    MemoryPool,
    MemoryUSMDevice,
    MemoryUSMHost,
    MemoryUSMShared,
    _Memory,  # noqa: F401  (the base, for isinstance checks)
)

__all__ = [
    "CopyWarning",
    "IPCEventHandle",
    "IPCMemoryHandle",
    "MemoryIPCDevice",
    "MemoryPool",
    "MemoryUSMDevice",
    "MemoryUSMHost",
    "MemoryUSMShared",
    "SyclIPCCloseMemHandle",
    "SyclIPCGetMemHandle",
    "SyclIPCOpenMemHandle",
    "host_array",
    "is_ipc_available",
    "torch_allocator",
    "torch_last_error",
    "torch_pool_info",
    "use_torch_allocator",
]


# ---- pickling: a copy; multiprocessing: the same memory --------------------
#
# pickle.dumps(mem) makes a copy, as dpctl does: the bytes and the kind, made
# again on unpickling (on the device of the same filter string if the
# process has it, else the default device). multiprocessing's queues, pipes
# and pools pickle with ForkingPickler, where memory of kind 'device' travels
# as an IPC handle and arrives as a MemoryIPCDevice over the same memory (as
# torch.multiprocessing does for tensors). The sender keeps the memory alive
# until the receiver is done with it (its mapping closed or collected: the
# handle's release ticket comes back), even if it dropped its last
# reference right after put(); a receiver that dies without closing leaves
# the memory held until the sender exits.
#
# A daemon thread (_reap) drops each kept handle once its tickets came back
# and its receivers' work is done, so the memory goes then, not at the
# sender's next put(). It does not poll: it sleeps in the library
# (usmipc._releases_wait, without the GIL) until a handle or bundle of this
# process has every ticket back, and then looks only at the ones named
# (their release keys), so a put() costs it nothing and a return costs it
# one lookup, however many handoffs are out (PyTorch's test_cuda_send_many
# keeps thousands). It runs Python code only in its own thread, with the
# GIL, never from the broker's. A handle whose tickets were all back before
# _keep() filed it, and one whose wait failed, are looked at again at the
# next wake (at most _REAP_WAIT_S later). Once nothing is kept it lingers
# for _REAPER_LINGER_S before it ends: a sender whose receivers return each
# message's ticket before the next put (a weight-update loop) would
# otherwise start a thread per message, and Thread.start() waits for the
# thread to run (0.28 ms of one tensor's 0.32 ms dumps, H200 run 55).

_kept: dict = {}  # release key -> the kept handles and bundles with it
_kept_lock = threading.Lock()
_due: list = []  # kept, to look at at the next wake (see above)
_reaper = None  # the _reap thread while one runs
_reap_seq = 0  # where the reaper stands in the library's log of returns
_REAP_WAIT_S = 0.1
_REAPER_LINGER_S = 10.0
_rescan = False  # something was kept while the reaper lingered: scan all


def _kept_handles() -> list:
    """Every kept handle and bundle (tests)."""
    with _kept_lock:
        return [h for hs in _kept.values() for h in hs]


def _all_back(h) -> bool:
    sent, back = h.releases  # one read: both counts at one instant
    return back >= sent


def _unkeep(h) -> bool:
    """Takes h out of _kept; False if it was not there. _kept_lock held."""
    hs = _kept.get(h._release_key)
    if hs is None or not any(x is h for x in hs):
        return False
    hs[:] = [x for x in hs if x is not h]
    if not hs:
        del _kept[h._release_key]
    return True


def _reap():
    """The reaper thread: _reap_loop, and should it fail, no reaper on
    record, so that the next _keep starts one (it looks at everything kept,
    this thread's handles included) instead of filing handles for ever
    with no thread to drop them."""
    global _reaper
    try:
        _reap_loop()
    except BaseException:
        with _kept_lock:
            if _reaper is threading.current_thread():
                _reaper = None
        raise


def _reap_loop():
    global _reaper, _reap_seq, _rescan
    scan_all = True  # handles kept before this thread ran
    idle_since = None  # when _kept was last seen empty
    while True:
        keys = ()
        if not scan_all:
            keys, _reap_seq, scan_all = _usmipc._releases_wait(
                _reap_seq, int(_REAP_WAIT_S * 1000))
        with _kept_lock:
            if _rescan:  # kept while this thread lingered: as if it began
                scan_all, _rescan = True, False
            if scan_all:
                look = [h for hs in _kept.values() for h in hs]
            else:
                look = [h for k in keys for h in _kept.get(k, ())]
            look += _due
            _due.clear()
            back = []
            for h in look:
                if _all_back(h) and _unkeep(h):
                    back.append(h)
        scan_all = False
        failed = []
        for h in back:
            try:
                h.wait_released()  # the receivers' queued work, if any
            except Exception:  # kept (and retried): never freed early
                failed.append(h)
        # The memory goes here, outside the lock; h too, or the last
        # handle dropped would live on while the thread lingers.
        del back, look
        h = None
        with _kept_lock:
            for h in failed:
                _kept.setdefault(h._release_key, []).append(h)
                _due.append(h)
            del failed
            h = None
            if _kept:
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= _REAPER_LINGER_S:
                _reaper = None
                return


def _keep(handle):
    """Keeps handle until its tickets came back (the reaper drops it)."""
    global _reaper, _rescan
    with _kept_lock:
        if not _kept and _reaper is not None:
            _rescan = True  # the reaper lingers: it looks at all at its wake
        _kept.setdefault(handle._release_key, []).append(handle)
        # Back already (a fast receiver): its return may have been logged
        # before it was filed here, and looked for in vain.
        if _all_back(handle):
            _due.append(handle)
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, name="usmipc-reaper",
                                       daemon=True)
            _reaper.start()


def _reset_after_fork():
    # The parent's reaper does not run in the child, and may have held the
    # lock when it forked; the library's log starts anew in the child.
    global _kept_lock, _reaper, _reap_seq, _rescan
    _kept_lock = threading.Lock()
    _reaper = None
    _reap_seq = 0
    _rescan = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


# ---- at exit: the tickets this process still holds ------------------------
#
# A receiver that still holds what it opened when it ends never closes it
# (the interpreter does not free every object at exit): a tensor a spawned
# Process got as its argument lives as long as multiprocessing's Process
# object, to the very end. Its ticket then never went back and the sender
# kept the memory until the sender exited. So the tickets of every open
# still held go back as the process ends (_usmipc._return_tickets_at_exit:
# after the work on each open's release stream): from atexit, and from
# multiprocessing's finalizers, which also run in the children of fork and
# forkserver (they leave by os._exit, without atexit). A process killed,
# or leaving by os._exit outside multiprocessing, still keeps them.


def _return_tickets_at_exit() -> None:
    try:
        _usmipc._return_tickets_at_exit()
    except Exception:  # at exit: the sender keeps the memory, as before
        pass


class _TicketsAtExit:
    """Registers _return_tickets_at_exit with multiprocessing's finalizers,
    again in each forked child (fork clears them)."""

    def __init__(self):
        import multiprocessing.util as util
        self._util = util
        self._register()
        util.register_after_fork(self, _TicketsAtExit._register)

    def _register(self):
        # exitpriority -100: after the finalizers of higher priority, which
        # may still use what was opened (multiprocessing runs them first).
        self._util.Finalize(self, _return_tickets_at_exit, exitpriority=-100)


atexit.register(_return_tickets_at_exit)
_tickets_at_exit = _TicketsAtExit()


def _argument_error(cls, message):
    """A usmipc.ArgumentError or ArgumentTypeError raised by this module,
    with the .code and .name the extension's own carry."""
    error = cls(message)
    error.code, error.name, error.native_code = (
        USMIPC_EINVAL, "USMIPC_EINVAL", 0)
    return error


def _copy_of(data, kind, filter_string):
    try:
        device = Device(filter_string)
    except Exception:  # not visible here: dpctl's default-queue behaviour
        device = Device()
    cls = {"host": MemoryUSMHost, "shared": MemoryUSMShared}.get(
        kind, MemoryUSMDevice)
    mem = cls(max(len(data), 1), device=device)
    if data:
        mem.copy_from_host(data)
    return mem


def _reduce_copy(mem):
    if mem.is_closed:
        raise _argument_error(ArgumentError, "cannot pickle a closed mapping")
    return _copy_of, (mem.tobytes(), mem.get_usm_type(),
                      mem.device.filter_string)


def _open_shared_memory(raw):
    return IPCMemoryHandle.open(raw)


# The metaclass of usmipc.Error: help() shows what usmipc defines, not the
# members every warning inherits from BaseException.
class CopyWarning(UserWarning, metaclass=type(_usmipc.Error)):
    """usmipc memory that ``multiprocessing`` (ForkingPickler) sends as a
    copy: host and shared memory, device memory of a device without IPC,
    and mappings of another process's memory. The receiver's writes do not
    come back. Silence it where a copy is what you want::

        warnings.filterwarnings("ignore", category=usmipc.memory.CopyWarning)
    """


def _warn_copy(mem, why, remedy):
    warnings.warn(
        f"{type(mem).__name__} of {mem.nbytes} bytes goes to the other "
        f"process as a copy ({why}): writes there do not come back here; "
        f"{remedy} (usmipc.memory.CopyWarning: silence it where a copy is "
        f"what you want)", CopyWarning, stacklevel=3)


def _reduce_share(mem):
    if mem.is_closed:
        raise _argument_error(ArgumentError, "cannot send a closed mapping")
    if mem.get_usm_type() != "device":
        _warn_copy(mem, f"only device memory is shared; this is "
                   f"{mem.get_usm_type()} memory",
                   "to share it, allocate MemoryUSMDevice (on 'host:cpu' for "
                   "host data, or usmipc.memory.host_array() for a NumPy "
                   "array)")
        return _reduce_copy(mem)
    if not mem.device.has_aspect_ipc_memory:
        _warn_copy(mem, f"{mem.device.filter_string} has no IPC",
                   "allocate on a device whose has_aspect_ipc_memory is True")
        return _reduce_copy(mem)
    handle = IPCMemoryHandle(mem, release=True)
    raw = handle.to_bytes()
    _keep(handle)
    return _open_shared_memory, (raw,)


for _cls in (MemoryUSMDevice, MemoryUSMHost, MemoryUSMShared,
             MemoryIPCDevice):
    copyreg.pickle(_cls, _reduce_copy)
# A mapping sent on arrives as a copy (its exporter's memory is not this
# process's to share), with a CopyWarning; an allocation of this process as
# the memory itself.


def _reduce_mapping(mem):
    if mem.is_closed:
        raise _argument_error(ArgumentError, "cannot send a closed mapping")
    _warn_copy(mem, "it maps another process's memory, which is not this "
               "one's to share", "to share it, send the handle bytes it was "
               "opened from (IPCMemoryHandle.to_bytes() of the exporter)")
    return _reduce_copy(mem)


for _cls in (MemoryUSMDevice, MemoryUSMHost, MemoryUSMShared):
    ForkingPickler.register(_cls, _reduce_share)
ForkingPickler.register(MemoryIPCDevice, _reduce_mapping)
del _cls


# ---- dpctl's free functions (dpctl.memory, the merged form of the seed) ----


def SyclIPCGetMemHandle(mem):
    """The IPC handle bytes of usmipc device memory ``mem`` (dpctl's name):
    ``IPCMemoryHandle(mem).to_bytes()``. The export belongs to the
    allocation, so the bytes stay valid while ``mem`` lives. Shared and host
    memory raise ``TypeError``; so does another library's array, whose
    export would end with the handle: keep an ``IPCMemoryHandle`` of it."""
    if not isinstance(mem, _Memory):
        raise _argument_error(
            ArgumentTypeError,
            "SyclIPCGetMemHandle() takes usmipc memory; for another "
            f"library's array ({type(mem).__name__}) keep an "
            "IPCMemoryHandle alive while the bytes are used")
    return IPCMemoryHandle(mem).to_bytes()


def SyclIPCOpenMemHandle(handle_bytes, device, nbytes):
    """Maps handle bytes on ``device``: a ``MemoryIPCDevice`` (a
    ``MemoryUSMDevice``) of ``nbytes`` (dpctl's name for
    ``IPCMemoryHandle.open``)."""
    return IPCMemoryHandle.open(handle_bytes, device, nbytes)


def SyclIPCCloseMemHandle(mem):
    """Closes a mapping (dpctl's name for ``IPCMemoryHandle.close_mapping``):
    afterwards ``mem._pointer == 0``, ``mem.nbytes == 0`` and
    ``mem.is_closed``; idempotent. Memory that is not a mapping raises
    ``RuntimeError`` (``usmipc.Error``)."""
    IPCMemoryHandle.close_mapping(mem)


def host_array(array: "Any", device: "Any" = "host:cpu") -> "Any":
    """A copy of ``array`` (anything ``numpy.asarray`` takes) in shareable
    host memory: a NumPy array of the same dtype and shape over a
    ``MemoryUSMDevice`` of the host backend, which it keeps alive.
    ``usmipc.share()`` and ``IPCMemoryHandle()`` take it (ordinary NumPy
    memory is private to its process and cannot be shared)::

        w = usmipc.memory.host_array(np.arange(10.0))
        bundle = usmipc.share({"w": w})
    """
    import numpy as np

    src = np.asarray(array)
    if src.dtype.hasobject:
        raise _argument_error(
            _usmipc.ArgumentTypeError,
            f"host_array(): an array of Python objects ({src.dtype}) has no "
            "bytes to share; convert it to a numeric dtype first")
    mem = MemoryUSMDevice(max(src.nbytes, 1), device=device)
    out = np.from_dlpack(mem)[:src.nbytes].view(src.dtype).reshape(src.shape)
    out[...] = src
    return out


def is_ipc_available(device=None):
    """True if memory of ``device`` can be shared with IPCMemoryHandle.

    ``device`` is a Device, a filter string, or None for the default device.
    """
    if not isinstance(device, Device):
        device = Device(device)
    return device.has_aspect_ipc_memory


# ---- PyTorch's CUDA allocator (docs/pools.md, "PyTorch allocator") ----------

_MALLOC, _FREE = "usmipc_torch_malloc", "usmipc_torch_free"
_torch_allocator = None
_torch_installed = False


def torch_allocator():
    """torch's CUDA allocator over usmipc pools, to install yourself.

    A ``torch.cuda.memory.CUDAPluggableAllocator`` whose functions are
    ``usmipc_torch_malloc`` and ``usmipc_torch_free`` of the C library that
    this package's extension links in (so its path is the extension's):
    every CUDA tensor it allocates is a block of a usmipc pool, one pool per
    device, and ``IPCMemoryHandle(tensor)`` shares it at the cost of one
    export per pool segment. ``use_torch_allocator()`` installs it; use this
    for ``torch.cuda.MemPool(torch_allocator().allocator())``. The same
    object on every call.
    """
    global _torch_allocator
    if _torch_allocator is None:
        import torch

        path = _usmipc.__file__
        lib = ctypes.CDLL(path)  # the extension itself, already loaded
        for name in (_MALLOC, _FREE):
            if not hasattr(lib, name):
                raise RuntimeError(
                    f"{path} does not export {name}; this build of the usmipc "
                    "extension is too old or stripped: reinstall usmipc")
        _torch_allocator = torch.cuda.memory.CUDAPluggableAllocator(
            path, _MALLOC, _FREE)
    return _torch_allocator


def use_torch_allocator():
    """Makes usmipc pools torch's CUDA allocator for the whole process.

    Call it before torch uses CUDA at all (the first CUDA tensor,
    ``torch.cuda.init()``, and anything else that initializes CUDA): torch
    swaps allocators only before its own has been initialized, and cannot
    swap back. From then on every CUDA tensor is a pool block, which
    ``IPCMemoryHandle(tensor)`` shares at the cost of one export per pool
    segment: a model's weights share in a few exports, and sharing them again
    costs no driver call. Returns the allocator (``torch_allocator()``);
    calling it again is a no-op. Raises ``RuntimeError`` if torch has
    initialized CUDA already.

    Under a pluggable allocator ``torch.cuda.memory_stats()`` and
    ``memory_allocated()`` raise (use ``torch_pool_info()``), and
    ``torch.cuda.empty_cache()`` gives nothing back; docs/pools.md lists the
    limits.
    """
    global _torch_installed
    import torch

    allocator = torch_allocator()
    if _torch_installed:
        return allocator
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "usmipc.memory.use_torch_allocator() must be called before torch "
            "initializes CUDA (before the first CUDA tensor or "
            "torch.cuda.init()); torch cannot change its allocator "
            "afterwards. Call it at the start of the program.")
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except RuntimeError as exc:
        raise RuntimeError(
            "torch refused to change its CUDA allocator (it has already "
            "allocated with its own); call usmipc.memory.use_torch_allocator() "
            f"before any CUDA work: {exc}") from exc
    _torch_installed = True
    return allocator


def torch_pool_info(device=0):
    """The pool behind the torch allocator on a CUDA device, as a dict.

    ``segments`` and ``segment_bytes`` (each segment is exported at most
    once, however many of its tensors are shared), ``blocks`` and
    ``block_bytes`` (tensors alive, in multiples of 512 bytes). Frees still
    waiting for their stream's work are waited for first, so only live
    tensors count. ``device`` is a CUDA device index, or anything with an
    ``index`` (a ``torch.device``). Does not import torch.
    """
    index = getattr(device, "index", device)
    return _usmipc._torch_pool_info(0 if index is None else index)


def torch_last_error():
    """Why the last usmipc call on this thread failed, as a sentence.

    torch does not check what a pluggable allocator returns: an allocation
    the pool cannot make gives a tensor whose ``data_ptr()`` is 0 (for a
    nonzero size) instead of ``torch.cuda.OutOfMemoryError``. Call this
    right after, on the same thread, to learn why (docs/pools.md).
    """
    return _usmipc._last_error()
