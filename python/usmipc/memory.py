"""Memory allocated by usmipc, and its sharing between processes.

``MemoryUSMDevice``, ``MemoryUSMHost`` and ``MemoryUSMShared`` allocate USM
memory of the three kinds; ``IPCMemoryHandle`` exports device memory and maps
it in another process as a ``MemoryIPCDevice``; ``MemoryPool`` hands out
blocks that share at the cost of one export per segment; its bytes are ordered by
default (importers wait for the producer's work before the handoff).
``IPCEventHandle`` (also ``usmipc.IPCEventHandle``) shares a ``usmipc.Event``
the same way. All are C types from ``usmipc._usmipc``; this module only
gathers them (dpctl's ``dpctl.memory`` layout).
"""

from usmipc._usmipc import (
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
    "IPCEventHandle",
    "IPCMemoryHandle",
    "MemoryIPCDevice",
    "MemoryPool",
    "MemoryUSMDevice",
    "MemoryUSMHost",
    "MemoryUSMShared",
    "is_ipc_available",
]


def is_ipc_available(device=None):
    """True if memory of ``device`` can be shared with IPCMemoryHandle.

    ``device`` is a Device, a filter string, or None for the default device.
    """
    if not isinstance(device, Device):
        device = Device(device)
    return device.has_aspect_ipc_memory
