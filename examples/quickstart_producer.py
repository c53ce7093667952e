"""Quick start, terminal 1: shares a dict of arrays and waits for a consumer.

    python examples/quickstart_producer.py [BYTES_FILE]
    python examples/quickstart_consumer.py [BYTES_FILE]     (terminal 2)

The producer puts two arrays in shareable host memory
(usmipc.memory.host_array), shares them with usmipc.share, and writes the
bundle's bytes to BYTES_FILE (default ./usmipc-quickstart.bytes): any
channel would do (a pipe, a socket, a queue). It then waits, up to two
minutes, until the consumer has written -1 into w[0] of the same memory,
and prints what it sees. The bundle must stay alive while consumers open
its bytes: that is why the producer waits."""
import pathlib
import sys
import time

import numpy as np

import usmipc
from usmipc.memory import host_array


def main() -> int:
    path = pathlib.Path(sys.argv[1] if len(sys.argv) > 1
                        else "usmipc-quickstart.bytes")
    w = host_array(np.arange(8, dtype=np.float32))
    b = host_array(np.full(3, 0.5))
    bundle = usmipc.share({"w": w, "b": b})  # keeps w and b alive
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(bundle.to_bytes())
    tmp.rename(path)  # the consumer never sees half the bytes
    print(f"producer: shared {bundle.arrays} arrays; bytes in {path}; "
          "waiting for the consumer", flush=True)
    deadline = time.monotonic() + 120
    while w[0] != -1 and time.monotonic() < deadline:
        time.sleep(0.05)
    if w[0] != -1:
        print("producer: no consumer wrote back within two minutes")
        return 1
    print(f"producer: the consumer wrote back: w[:3] = {w[:3].tolist()}")
    path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
