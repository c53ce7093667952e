"""The seed's example (the dpctl pull request's test run), translated line for
line to usmipc's names. Run it on any device:

    python examples/seed_example.py                   # host:cpu
    python examples/seed_example.py cuda:gpu
    ZE_ENABLE_ALT_DRIVERS=$PWD/build/tests/level_zero/libze_usmipc_test_driver.so \\
        python examples/seed_example.py level_zero:gpu

The seed opened the handle in the process that exported it; usmipc returns
an alias of the original memory there. `python -m usmipc demo` does the same
across two processes.
"""
import sys

import usmipc
from usmipc.memory import MemoryUSMDevice
from usmipc.memory import IPCMemoryHandle

d = usmipc.Device(sys.argv[1] if len(sys.argv) > 1 else "host:cpu")
q = usmipc.Queue(d)
mem = MemoryUSMDevice(4096, queue=q)
h = IPCMemoryHandle(mem)
raw = h.to_bytes()
print(f"IPC handle: {len(raw)} bytes")
mem2 = IPCMemoryHandle.open(raw, d, nbytes=4096)
print(f"Opened: {mem2.nbytes} bytes on {mem2.sycl_device.name}")
IPCMemoryHandle.close_mapping(mem2)
print("close OK")
