"""Every public callable of the package, called with arguments of the wrong
type, range and state, on objects in every state (fresh, closed, freed,
pickled): nothing may crash the interpreter. An exception of any kind is a
pass; a segfault, an abort or a hang is a failure. The calls run in a child
interpreter (with faulthandler, so a crash prints its stack) under fixed
seeds: a failure is reproducible with `python tests/python/test_api_fuzz.py
SEED ROUNDS`.
"""
import os
import subprocess
import sys

import pytest

HERE = os.path.abspath(__file__)


def fuzz(seed: int, rounds: int) -> int:
    import faulthandler
    import pickle
    import random

    faulthandler.enable()
    import numpy as np

    import usmipc
    import usmipc.memory as M

    d = usmipc.Device("host")
    q = usmipc.Queue(d)
    pool = M.MemoryPool(device=d)
    first = M.MemoryUSMDevice(4096, device=d)
    raw = M.IPCMemoryHandle(first).to_bytes()

    def fixtures():
        o = {"d": d, "q": q, "pool": pool}
        o["mem"] = M.MemoryUSMDevice(4096, device=d)
        o["host"] = M.MemoryUSMHost(64, device=d)
        o["shared"] = M.MemoryUSMShared(64, device=d)
        o["poolmem"] = pool.allocate(256)
        o["handle"] = M.IPCMemoryHandle(o["mem"])
        # This process's own handle opens as an alias of the memory.
        o["mapping"] = M.IPCMemoryHandle.open(o["handle"].to_bytes(), d)
        o["event"] = usmipc.Event(q)
        o["event_handle"] = usmipc.IPCEventHandle(o["event"])
        o["bundle"] = usmipc.share({"a": o["mem"], "b": [o["poolmem"]]})
        # With release tickets, and a leaf of an open that holds one.
        o["ticketed"] = usmipc.share([o["mem"]], release=True)
        o["leaf"] = usmipc.open_shared(o["ticketed"].to_bytes())[0]
        return o

    weird = [None, -1, 0, 1, 2**64, -2**63, 1.5, float("nan"), "", "host",
             "cuda:gpu:99", b"", raw, raw[:40], raw + b"\0", bytearray(raw),
             memoryview(raw)[::2], object(), [], {}, d, first, True,
             np.zeros(3), np.zeros((2, 2))[:, 0], lambda: 0, type]
    functions = [usmipc.open_shared, usmipc.close_shared, usmipc.share,
                 usmipc.release_shared,
                 usmipc.strerror, usmipc.errorcode, usmipc.Device,
                 usmipc.Queue, usmipc.Event, usmipc.IPCEventHandle,
                 M.IPCMemoryHandle, M.IPCMemoryHandle.open,
                 M.IPCMemoryHandle.close_mapping, M.IPCMemoryHandle.release,
                 M.SyclIPCGetMemHandle, M.SyclIPCOpenMemHandle,
                 M.SyclIPCCloseMemHandle, M.MemoryUSMDevice, M.MemoryUSMHost,
                 M.MemoryUSMShared, M.MemoryPool, pickle.loads]
    functions = [f for f in functions if callable(f)]
    dunders = {"__dlpack__", "__dlpack_device__", "__reduce__",
               "__reduce_ex__", "__len__", "__getitem__", "__setitem__",
               "__bytes__", "__enter__", "__exit__", "__iter__",
               "__array__"}
    never = {"wait", "wait_released", "print_device_info", "barrier"}
    rng = random.Random(seed)
    calls = 0
    for _ in range(rounds):
        o = fixtures()
        names = list(o)
        rng.shuffle(names)
        for name in names:
            x = o[name]
            methods = [a for a in dir(x)
                       if (not a.startswith("_") or a in dunders)
                       and a not in never]
            for a in methods:
                try:
                    f = getattr(x, a)
                except BaseException:
                    continue
                if not callable(f):
                    continue
                for k in range(4):
                    args = [rng.choice(weird) for _ in range(k)]
                    try:
                        f(*args)
                    except BaseException:
                        pass
                    calls += 1
            # Close, free and release in any order, then use again below.
            for end in ("close", "free", "release", "destroy"):
                if hasattr(x, end) and name not in ("d", "q", "pool"):
                    try:
                        getattr(x, end)()
                    except BaseException:
                        pass
            try:
                pickle.loads(pickle.dumps(x))
            except BaseException:
                pass
        values = [v for v in o.values() if v is not None]
        for f in functions:
            for k in range(1, 4):
                args = [rng.choice(weird + values) for _ in range(k)]
                try:
                    f(*args)
                except BaseException:
                    pass
                calls += 1
    return calls


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_no_argument_or_state_crashes(seed):
    run = subprocess.run([sys.executable, HERE, str(seed), "100"],
                         capture_output=True, text=True, timeout=240)
    tail = (run.stdout + run.stderr)[-4000:]
    assert run.returncode == 0, f"seed {seed}: exit {run.returncode}\n{tail}"
    assert "calls " in run.stdout, tail
    assert int(run.stdout.split("calls ")[-1].split()[0]) > 10000, tail


if __name__ == "__main__":
    seed, rounds = int(sys.argv[1]), int(sys.argv[2])
    # Whatever the calls print (repr of odd objects) is not the result.
    with open(os.devnull, "w") as sink:
        saved = os.dup(1)
        os.dup2(sink.fileno(), 1)
        try:
            n = fuzz(seed, rounds)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
    print(f"calls {n}", flush=True)
