"""Sharing memory and events between processes: ``from usmipc.ipc import
IPCMemoryHandle``, as the seed's ``dpctl.ipc`` (the same classes as in
:mod:`usmipc.memory`).

``is_available(device=None)`` says whether memory of a device can be shared,
so that a program can fall back to copies where IPC is not offered (the
seed reviewer's wish), instead of a package that fails to import.
"""

from usmipc._usmipc import IPCEventHandle, IPCMemoryHandle
from usmipc.memory import is_ipc_available as is_available

__all__ = ["IPCEventHandle", "IPCMemoryHandle", "is_available"]
