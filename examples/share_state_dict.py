"""A tree of arrays shared with another process in one handoff.

    python examples/share_state_dict.py [DEVICE]      (default host:cpu)

The producer allocates a few arrays in one pool (so one allocation travels),
shares {"embed": ..., "layers": [...]} with usmipc.share, and sends the
bundle's bytes through a pipe to a process started with spawn; that process
opens them with usmipc.open_shared (no copy: the arrays are mappings of the
producer's memory) and checks every array's bytes. Prints "bundle OK"."""
import multiprocessing
import sys
from multiprocessing.connection import Connection

import usmipc
from usmipc.memory import MemoryPool


def consumer(conn: Connection, device: str) -> None:
    tree = usmipc.open_shared(conn.recv(), device=device)
    embed, (w0, w1) = tree["embed"], tree["layers"]
    ok = (embed.tobytes() == bytes([1]) * 4096 and
          w0.tobytes() == bytes([2]) * 1000 and
          w1.tobytes() == bytes([3]) * 10)
    print(f"consumer: {embed!r}, {w0!r}, {w1!r}: {'ok' if ok else 'WRONG'}")
    conn.send(ok)
    usmipc.close_shared(tree)


def main() -> int:
    device = usmipc.Device(sys.argv[1] if len(sys.argv) > 1 else "host:cpu")
    pool = MemoryPool(device=device)
    blocks = [pool.allocate(n) for n in (4096, 1000, 10)]
    for i, block in enumerate(blocks):
        block.memset(i + 1)
    bundle = usmipc.share({"embed": blocks[0], "layers": [blocks[1], blocks[2]]})
    print(f"producer: {bundle!r}, {len(bundle.to_bytes())} bytes")
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=consumer, args=(child, device.filter_string))
    proc.start()
    parent.send(bundle.to_bytes())
    ok = parent.recv() if parent.poll(60) else False
    proc.join(60)
    if not ok or proc.exitcode != 0:
        print("bundle FAILED")
        return 1
    print("bundle OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
