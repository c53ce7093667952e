"""Quick start, terminal 2: opens what quickstart_producer.py shared.

    python examples/quickstart_consumer.py [BYTES_FILE]

Reads the bundle's bytes, opens them with usmipc.open_shared (the arrays
are mappings of the producer's memory: no copy), checks the values, writes
-1 into w[0] (the producer sees it), and closes."""
import pathlib
import sys

import numpy as np

import usmipc


def main() -> int:
    path = pathlib.Path(sys.argv[1] if len(sys.argv) > 1
                        else "usmipc-quickstart.bytes")
    tree = usmipc.open_shared(path.read_bytes())
    w, b = np.from_dlpack(tree["w"]), np.from_dlpack(tree["b"])
    print(f"consumer: w = {w.tolist()}, b = {b.tolist()}")
    ok = w.tolist() == list(range(8)) and b.tolist() == [0.5] * 3
    w[0] = -1  # into the producer's memory
    del w, b
    usmipc.close_shared(tree)
    print("consumer:", "ok" if ok else "WRONG VALUES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
