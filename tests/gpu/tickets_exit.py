"""Release tickets whose consumers exit (issue 21 #2), on a real GPU.

(a) Two consumers of one handoff: A returns its ticket, synchronizes and
    exits; B returns its ticket while a ~3 s kernel still runs on the
    mapping and then writes 7 over it. The producer's wait_released(stream)
    must not fail (before the fix: USMIPC_EEXPORTERGONE, opening A's event)
    and must order the producer's stream after B's kernel: the producer
    adds 100 on its stream, and every element reads 107. Then the same with
    a host wait: a short event timeout times out on every call while B
    runs, the full wait ends after B's kernel.
(b) A consumer whose kernels keep writing 13 into the producer's buffer for
    ~10 s returns its ticket and is SIGKILLed (before the producer's wait,
    and during it): wait_released returns, the producer writes 42, and 5 s
    later the buffer still reads 42 everywhere (the dead consumer's work
    wrote nothing after the wait returned).

Prints one PASS or FAIL line per check and a summary; exit status 0 only
when everything passed.
    python3 tests/gpu/tickets_exit.py            # CUDA device 0, torch
    python3 tests/gpu/tickets_exit.py --host     # dry run on the host device
On the host device there are no kernels: consumers sleep and write from
the host, so the run checks the protocol (tickets, exits, kills, the
answers of the wait), not device ordering.
"""
import os
import signal
import subprocess
import sys
import threading
import time

N = 1 << 20  # int32 elements
BUSY_MS = 3000
WRITE_MS = 10000
results = []
# Spins `cycles` clock cycles, then writes v over y (repeat: writes v over
# y again and again until the cycles have passed).
KERNEL = r"""
extern "C" __global__ void busy_write(int *y, long long n, long long cycles,
                                      int v, int repeat) {
  long long start = clock64();
  long long stride = (long long)blockDim.x * gridDim.x;
  long long i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  volatile int *out = y;
  if (repeat) {
    while (clock64() - start < cycles)
      for (long long i = i0; i < n; i += stride) out[i] = v;
  } else {
    while (clock64() - start < cycles) {
    }
    for (long long i = i0; i < n; i += stride) out[i] = v;
  }
}
"""


def report(ok, name, detail=""):
    results.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}",
          flush=True)


# ---- the device: torch on CUDA, or usmipc host memory ----------------------

class Cuda:
    def __init__(self):
        import torch
        self.torch = torch
        # torch.cuda._sleep spins for a number of clock cycles: calibrate
        # cycles per millisecond with events rather than trust a reported
        # clock rate (its unit and presence vary with the CUDA release).
        torch.cuda._sleep(1000)  # warm-up
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        cycles = 50_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        self.cycles_per_ms = cycles / start.elapsed_time(end)
        print(f"_sleep: {self.cycles_per_ms:.0f} cycles per ms",
              file=sys.stderr, flush=True)

    def sleep(self, ms):  # a kernel spinning ms milliseconds on the stream
        self.torch.cuda._sleep(int(self.cycles_per_ms * ms))

    # producer
    def buffer(self):
        self.x = self.torch.zeros(N, dtype=self.torch.int32, device="cuda:0")
        self.stream = self.torch.cuda.current_stream()
        return self.x

    def fill(self, v):
        self.x.fill_(v)

    def add(self, v):
        self.x.add_(v)

    def sync(self):
        self.torch.cuda.synchronize()

    def values(self):  # the distinct values in the buffer
        self.sync()
        return sorted(set(self.torch.unique(self.x).cpu().tolist()))

    # consumer
    def consumer_stream(self):
        return self.torch.cuda.Stream()

    def open_view(self, m, s):
        with self.torch.cuda.stream(s):
            return self.torch.from_dlpack(m).view(self.torch.int32)

    def write(self, y, v, s, busy_ms=0, repeat=False):
        """One kernel on s: spins busy_ms, then writes v everywhere (repeat:
        writes v over and over for busy_ms). One launch, because on the
        H200 machine a second launch can block the host until the first
        kernel ends, plain torch included (run 36:
        bench/results/h200-2026-12-01-issue21/run36_launch_diag.txt), and
        the consumer must return its ticket while its work still runs."""
        if not busy_ms:
            with self.torch.cuda.stream(s):
                y.fill_(v)
            return
        # CuPy must not synchronize on the stream torch names in the
        # tensor's __cuda_array_interface__: the kernel goes on s.
        os.environ["CUPY_CUDA_ARRAY_INTERFACE_SYNC"] = "0"
        import cupy
        import numpy as np
        if not hasattr(self, "kernel"):
            self.kernel = cupy.RawKernel(KERNEL, "busy_write")
        with cupy.cuda.ExternalStream(s.cuda_stream):
            self.kernel((264,), (256,),
                        (cupy.asarray(y), np.int64(y.numel()),
                         np.int64(self.cycles_per_ms * busy_ms), np.int32(v),
                         np.int32(1 if repeat else 0)))

    def stream_sync(self, s):
        s.synchronize()


class Host:
    """The host device: the same steps without kernels."""

    def __init__(self):
        import numpy as np
        import usmipc
        from usmipc.memory import MemoryUSMDevice
        self.np = np
        self.dev = usmipc.Device("host:cpu")
        self.cls = MemoryUSMDevice

    def buffer(self):
        self.x = self.cls(4 * N, device=self.dev)
        self.stream = None
        self.fill(0)
        return self.x

    def _get(self):
        return self.np.frombuffer(bytes(self.x.copy_to_host()), self.np.int32)

    def fill(self, v):
        self.x.copy_from_host(self.np.full(N, v, self.np.int32).tobytes())

    def add(self, v):
        self.x.copy_from_host((self._get() + v).astype(self.np.int32).tobytes())

    def sync(self):
        pass

    def values(self):
        return sorted(set(self._get().tolist()))

    def consumer_stream(self):
        return None

    def open_view(self, m, s):
        return m

    def write(self, y, v, s, busy_ms=0):
        if busy_ms:
            time.sleep(busy_ms / 1000)
        y.copy_from_host(self.np.full(N, v, self.np.int32).tobytes())

    def stream_sync(self, s):
        pass


# ---- consumers: this file run with --consumer ROLE -------------------------

def consumer(role, dev):
    from usmipc.memory import IPCMemoryHandle
    s = dev.consumer_stream()
    print("ready", flush=True)
    raw = bytes.fromhex(sys.stdin.readline().strip())
    m = IPCMemoryHandle.open(raw, None, stream=s)
    y = dev.open_view(m, s)
    if role == "exit":  # done at once: returns, synchronizes, exits
        IPCMemoryHandle.release(m, stream=s)
        dev.stream_sync(s)
        del y
        IPCMemoryHandle.close_mapping(m)
        print("released", flush=True)
        return
    if role == "busy":  # a ~3 s kernel, then 7 everywhere; returns at once
        t0 = time.perf_counter()
        dev.write(y, 7, s, BUSY_MS)  # (the host: done before it returns)
        t1 = time.perf_counter()
        IPCMemoryHandle.release(m, stream=s)
        t2 = time.perf_counter()
        # Where B's time went, for a failed ordering check: queueing the
        # kernel and returning the ticket should both take milliseconds.
        print(f"B: queued the kernel in {t1 - t0:.3f} s, returned the ticket "
              f"in {t2 - t1:.3f} s", file=sys.stderr, flush=True)
        print("released", flush=True)
        sys.stdin.readline()  # until told to quit
        dev.stream_sync(s)
        del y
        IPCMemoryHandle.close_mapping(m)
        return
    if role == "writer":  # ~10 s of kernels writing 13, then returns
        if isinstance(dev, Host):
            dev.write(y, 13, s)
        else:
            dev.write(y, 13, s, WRITE_MS, repeat=True)
        IPCMemoryHandle.release(m, stream=s)
        print("released", flush=True)
        sys.stdin.readline()  # until killed
        return
    raise SystemExit(f"unknown role {role}")


# ---- the producer ----------------------------------------------------------

class Child:
    def __init__(self, role, host):
        args = [sys.executable, os.path.abspath(__file__), "--consumer", role]
        if host:
            args.append("--host")
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"consumer {role} did not start ({line!r})")

    def give(self, raw):
        self.p.stdin.write(raw.hex() + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline().strip()
        if line != "released":
            raise RuntimeError(f"consumer said {line!r}, not 'released'")

    def quit(self):
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
        except BrokenPipeError:
            pass
        return self.p.wait(timeout=60)

    def kill(self):
        self.p.send_signal(signal.SIGKILL)
        return self.p.wait(timeout=60)


def try_wait(h, stream=None):
    """wait_released's outcome: (None, seconds) or (error name, seconds)."""
    import usmipc
    t0 = time.perf_counter()
    try:
        h.wait_released(stream=stream)
        return None, time.perf_counter() - t0
    except usmipc.Error as e:
        return f"{e.name}: {e}", time.perf_counter() - t0


def part_a(dev, host):
    import usmipc
    from usmipc.memory import IPCMemoryHandle
    x = dev.buffer()
    h = IPCMemoryHandle(x, release=True)
    for wait_on in (["stream", "host"] if not host else ["host"]):
        dev.fill(0)
        dev.sync()
        a, b = Child("exit", host), Child("busy", host)
        a.give(h.to_bytes())
        report(a.quit() == 0, f"a/{wait_on}: consumer A exited cleanly")
        b.give(h.to_bytes())
        released = time.perf_counter()
        if wait_on == "stream":
            err, took = try_wait(h, dev.stream)
            report(err is None, "a/stream: wait_released(stream) after A "
                   "exited", err or f"returned in {took * 1e3:.1f} ms")
            dev.add(100)  # on the producer's stream: after B's kernel
            dev.sync()
        else:
            usmipc.set_event_timeout(0.3)
            answers = [try_wait(h)[0] for _ in range(3)]
            usmipc.set_event_timeout(None)
            # (the host device: B's work was done before it returned)
            report(all(e is None for e in answers) if host else
                   all(e is not None and "ETIMEDOUT" in e for e in answers),
                   "a/host: a short limit times out on every call while B "
                   "runs", "; ".join(str(e) for e in answers))
            err, took = try_wait(h)
            report(err is None, "a/host: the full wait", err or
                   f"{took:.2f} s")
            dev.add(100)
        after = time.perf_counter() - released
        if not host:
            report(after >= BUSY_MS / 1000 * 0.8,
                   f"a/{wait_on}: the producer's write waited for B's kernel",
                   f"{after:.2f} s after B's release")
        vals = dev.values()
        report(vals == [107], f"a/{wait_on}: B's result intact, then the "
               "producer's write", f"values {vals}")
        err, _ = try_wait(h)
        report(err is None, f"a/{wait_on}: the same answer on the next call",
               err or "0")
        report(b.quit() == 0, f"a/{wait_on}: consumer B exited cleanly")
    return h


def part_b(dev, host, h):
    for when in ("before", "during"):
        dev.fill(0)
        dev.sync()
        c = Child("writer", host)
        c.give(h.to_bytes())
        time.sleep(1.0)
        vals = dev.values()
        report(13 in vals, f"b/{when}: the consumer is writing",
               f"values {vals}")
        outcome = {}
        if when == "before":
            rc = c.kill()
            report(rc == -signal.SIGKILL, "b/before: consumer killed",
                   f"rc {rc}")
            outcome["err"], took = try_wait(h)
        else:
            t = threading.Thread(
                target=lambda: outcome.update(zip(("err", "took"),
                                                  try_wait(h))))
            t.start()
            t.join(1.0)
            report(t.is_alive() or host,
                   "b/during: the wait waits while the consumer lives and "
                   "writes")
            rc = c.kill()
            t.join(30)
            report(not t.is_alive(), "b/during: the wait ended after the kill")
        err = outcome.get("err")
        report(err is None, f"b/{when}: wait_released after the kill",
               err or "returned")
        dev.fill(42)
        dev.sync()
        time.sleep(5)
        vals = dev.values()
        report(vals == [42], f"b/{when}: nothing written after the wait, 5 s "
               "later", f"values {vals}")


def main():
    host = "--host" in sys.argv
    if "--consumer" in sys.argv:
        role = sys.argv[sys.argv.index("--consumer") + 1]
        consumer(role, Host() if host else Cuda())
        return 0
    signal.signal(signal.SIGALRM, lambda *_: (print("FAIL watchdog: the run "
                                                    "took over 300 s",
                                                    flush=True),
                                              os._exit(1)))
    signal.alarm(300)
    try:
        dev = Host() if host else Cuda()
    except Exception as e:  # no torch, no GPU
        print(f"FAIL setup: {type(e).__name__}: {e}", flush=True)
        return 1
    print(f"tickets_exit on {'the host device' if host else 'cuda:0'}, "
          f"USMIPC_CUDA_IPC={os.environ.get('USMIPC_CUDA_IPC', '')}",
          flush=True)
    for name, part in (("a", lambda: part_a(dev, host)),):
        try:
            h = part()
        except Exception as e:
            report(False, f"{name}: raised", f"{type(e).__name__}: {e}")
            h = None
    if h is None:
        from usmipc.memory import IPCMemoryHandle
        dev.buffer()
        h = IPCMemoryHandle(dev.x, release=True)
    try:
        part_b(dev, host, h)
    except Exception as e:
        report(False, "b: raised", f"{type(e).__name__}: {e}")
    ok = all(results)
    print(f"{'ALL PASS' if ok else 'SOME FAILED'}: {sum(results)} of "
          f"{len(results)} checks passed", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
