"""A multiprocessing pool whose workers write into the parent's memory:
device memory (here on host:cpu; "cuda:gpu:0" on a GPU) travels to each
worker as the same memory, so their writes are the parent's data
(docs/multiprocessing.md).

    python examples/pool_workers.py [DEVICE]
"""
import multiprocessing
import sys

import usmipc
from usmipc.memory import MemoryUSMDevice


def fill(job: tuple[MemoryUSMDevice, int]) -> int:
    """Runs in a worker, where mem maps the parent's memory."""
    mem, value = job
    mem.copy_from_host(bytes([value]) * mem.nbytes)
    return value


if __name__ == "__main__":
    dev = usmipc.Device(sys.argv[1] if len(sys.argv) > 1 else "host:cpu")
    blocks = [MemoryUSMDevice(16, device=dev) for _ in range(4)]
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        done = pool.map(fill, [(m, i + 1) for i, m in enumerate(blocks)])
    print("workers wrote", done)
    seen = [bytes(m.copy_to_host()) for m in blocks]
    print("parent sees", [b[0] for b in seen])
    assert seen == [bytes([i + 1]) * 16 for i in range(4)]
    print("ok")
