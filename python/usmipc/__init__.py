"""usmipc: zero-copy sharing of accelerator memory between processes.

Devices, queues, events and errors live here; memory and IPC handles in
:mod:`usmipc.memory` (the layout of dpctl, whose Python API usmipc mirrors)::

    import usmipc
    from usmipc.memory import MemoryUSMDevice, IPCMemoryHandle

    d = usmipc.Device("host:cpu")
    mem = MemoryUSMDevice(4096, device=d)
    raw = IPCMemoryHandle(mem).to_bytes()      # send to another process
    m2 = IPCMemoryHandle.open(raw, d)          # ... which maps the memory
    IPCMemoryHandle.close_mapping(m2)

Handles are ordered by default: each ``to_bytes()`` records a fresh event on
the producer's queue (none when it is idle: a completed record serves), and ``open()`` waits for it (on the host, or on the
device with ``stream=``), so the importer never sees the data before the
producer's work on it is done. ``Event`` and ``IPCEventHandle`` order work
across processes by hand; ``Queue.from_stream()`` wraps a torch, CuPy or
``__cuda_stream__`` stream (every ``stream=`` argument takes the same).
"""

from usmipc._usmipc import (
    COMPILED_VERSION_HEX,
    VERSION_HEX,
    ArgumentError,
    ArgumentTypeError,
    Device,
    Error,
    Event,
    IPCEventHandle,
    IPCTimeoutError,
    MemoryKindError,
    OutOfMemoryError,
    Queue,
    SharedArray,
    SharedBundle,
    SyclDeviceCreationError,
    __version__,
    backends,
    close_shared,
    errorcode,
    forward_shared,
    get_devices,
    open_shared,
    release_shared,
    reset_stats,
    set_event_timeout,
    set_ipc_cache_bytes,
    set_ipc_cache_size,
    set_ipc_timeout,
    share,
    stats,
    strerror,
)

# The C library is linked into the extension; the extension refuses to load
# if the library's version differs from the one it was compiled against.
# Check once more here in case an old extension sits beside new Python code.
if VERSION_HEX != COMPILED_VERSION_HEX:  # pragma: no cover
    raise ImportError(
        f"usmipc C library version {VERSION_HEX:#08x} does not match the "
        f"version the extension was built for ({COMPILED_VERSION_HEX:#08x})"
    )

from usmipc import _usmipc  # noqa: E402
from usmipc import memory  # noqa: E402  (after the version check)
from usmipc import ipc  # noqa: E402
from usmipc import distributed  # noqa: E402  (imports torch/mpi4py lazily)
from usmipc.update import UpdatePlan  # noqa: E402

# dpctl's names for the same classes, so that a program written for dpctl
# runs with its import lines changed (the seed's example does).
SyclDevice = Device
"""dpctl's name for Device (the same class)."""
SyclQueue = Queue
"""dpctl's name for Queue (the same class)."""


def get_num_devices(backend=None, device_type=None):
    """The number of devices, of a backend ('host', 'cuda', 'level_zero')
    and of a type ('cpu', 'gpu') if given (dpctl's function)."""
    return sum(1 for d in get_devices()
               if (backend is None or d.backend == backend)
               and (device_type is None or d.device_type == device_type))


def has_gpu_devices(backend=None):
    """True if this process sees a GPU (of the backend, if given)."""
    return get_num_devices(backend, "gpu") > 0


def has_cpu_devices(backend=None):
    """True if this process sees a CPU device (the host backend's)."""
    return get_num_devices(backend, "cpu") > 0


def select_default_device():
    """The default device: USMIPC_DEFAULT_DEVICE if set, else the first GPU,
    else the host (dpctl's function; the same as Device())."""
    return Device()

# The error codes, USMIPC_EINVAL ... (errorcode maps each back to its name).
globals().update({name: getattr(_usmipc, name)
                  for name in _usmipc.errorcode.values()})

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "Device",
    "Error",
    "Event",
    "IPCEventHandle",
    "IPCTimeoutError",
    "MemoryKindError",
    "OutOfMemoryError",
    "Queue",
    "SharedArray",
    "SharedBundle",
    "UpdatePlan",
    "SyclDevice",
    "SyclDeviceCreationError",
    "SyclQueue",
    "__version__",
    "backends",
    "close_shared",
    "distributed",
    "errorcode",
    "forward_shared",
    "get_devices",
    "get_num_devices",
    "has_cpu_devices",
    "has_gpu_devices",
    "ipc",
    "memory",
    "open_shared",
    "release_shared",
    "reset_stats",
    "select_default_device",
    "set_event_timeout",
    "set_ipc_cache_bytes",
    "set_ipc_cache_size",
    "set_ipc_timeout",
    "share",
    "stats",
    "strerror",
]
# Also public: the error codes (a list apart, so that tools that read
# __all__ without running the module, as the documentation's griffe does,
# still see the names above).
__all__ += list(_usmipc.errorcode.values())
