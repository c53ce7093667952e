"""Stream-ordered sharing on a real GPU (issue 10).

A producer zeroes a buffer, launches a long kernel and then writes a value on
the same stream, and exports at once without synchronizing; a consumer that
was started separately (and waits on a pipe) opens with its own stream and
reads the value on that stream. With the default (ordered handles) it must
read the new value every time; handle creation and to_bytes() must return
while the producer's kernel still runs; and a control with ordering off must
show that the test can see a missing wait (a stale value at least once).

Runs where a CUDA device is present (tests/gpu/run.sh); skips elsewhere.
"""
import os
import subprocess
import sys
import textwrap
import time

import pytest

usmipc = pytest.importorskip("usmipc")
from usmipc.memory import IPCMemoryHandle  # noqa: E402

try:
    GPU = usmipc.Device("cuda:gpu:0")
except Exception as exc:  # pragma: no cover - CPU machines
    pytestmark = pytest.mark.skip(reason=f"no CUDA device: {exc}")
    GPU = None

TRIALS = int(os.environ.get("USMIPC_EVENT_TRIALS", "100"))
CONTROL_TRIALS = 10
SLEEP_MS = 200
N = 1 << 20  # int32 elements

# A consumer loop: one hex handle per line in, one value per line out. The
# framework and the way of opening are chosen by argv.
CONSUMER = textwrap.dedent(r"""
    import sys
    import usmipc
    from usmipc.memory import IPCMemoryHandle
    framework, ordered, gpu = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
    dev = usmipc.Device(f"cuda:gpu:{gpu}")
    if framework == "torch":
        import torch
        stream = torch.cuda.Stream(device=gpu)
    else:
        import cupy as cp
        cp.cuda.Device(gpu).use()
        stream = cp.cuda.Stream(non_blocking=True)
    print("ready", flush=True)
    for line in sys.stdin:
        raw = bytes.fromhex(line.strip())
        m = IPCMemoryHandle.open(raw, dev, stream=stream, ordered=ordered)
        if framework == "torch":
            with torch.cuda.stream(stream):
                x = torch.from_dlpack(m).view(torch.int32)
                value = int(x[-1].cpu())
        else:
            with stream:
                x = cp.from_dlpack(m).view(cp.int32)
                value = int(x[-1:].get(stream=stream)[0])
        del x
        IPCMemoryHandle.close_mapping(m)
        print(value, flush=True)
""")


def start_consumer(framework, ordered, gpu=0):
    p = subprocess.Popen([sys.executable, "-c", CONSUMER, framework,
                          "1" if ordered else "0", str(gpu)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.strip() == "ready", p.stderr.read()
    return p


def ask(p, raw):
    p.stdin.write(raw.hex() + "\n")
    p.stdin.flush()
    line = p.stdout.readline()
    assert line, p.stderr.read()
    return int(line)


def torch_producer():
    torch = pytest.importorskip("torch")
    x = torch.zeros(N, dtype=torch.int32, device="cuda:0")
    # Cycles for SLEEP_MS at the GPU's clock (torch.cuda._sleep spins).
    rate_khz = torch.cuda.get_device_properties(0).clock_rate \
        if hasattr(torch.cuda.get_device_properties(0), "clock_rate") else 1980000
    cycles = int(rate_khz * SLEEP_MS)

    def launch(value):
        x.zero_()
        torch.cuda._sleep(cycles)
        x.fill_(value)

    def running():
        return not torch.cuda.current_stream().query()

    return x, launch, running, torch.cuda.synchronize


SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


def cupy_producer():
    cp = pytest.importorskip("cupy")
    x = cp.zeros(N, dtype=cp.int32)
    spin = cp.RawKernel(SPIN, "spin")
    stream = cp.cuda.get_current_stream()

    def launch(value):
        x.fill(0)
        spin((1,), (1,), (cp.uint64(SLEEP_MS * 1000000),))
        x.fill(value)

    def running():
        return not stream.done

    return x, launch, running, stream.synchronize


def handoff_trials(producer, framework, ordered, trials, gpu=0):
    x, launch, running, sync = producer()
    consumer = start_consumer(framework, ordered, gpu)
    try:
        values, create_us, still_running = [], [], []
        for t in range(trials + 1):  # trial 0 warms up (first export, open)
            sync()
            launch(1000 + t)
            t0 = time.perf_counter()
            h = IPCMemoryHandle(x, ordered=ordered)
            raw = h.to_bytes()
            t1 = time.perf_counter()
            run = running()
            value = ask(consumer, raw)
            sync()
            del h
            if t == 0:
                continue
            values.append(value == 1000 + t)
            create_us.append((t1 - t0) * 1e6)
            still_running.append(run)
        return values, create_us, still_running
    finally:
        consumer.stdin.close()
        consumer.wait(timeout=60)


@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_ordered_handoff_reads_new_value_every_time(framework):
    producer = torch_producer if framework == "torch" else cupy_producer
    ok, create_us, running = handoff_trials(producer, framework, True, TRIALS)
    create_us.sort()
    print(f"\n{framework}: {sum(ok)}/{len(ok)} trials read the new value; "
          f"handle + to_bytes median {create_us[len(create_us) // 2]:.1f} us, "
          f"max {create_us[-1]:.1f} us; kernel still running after to_bytes "
          f"in {sum(running)}/{len(running)}")
    assert all(ok), f"{ok.count(False)} of {len(ok)} ordered trials read stale data"
    assert all(running), "to_bytes() returned after the producer's kernel: that is a host synchronize"
    assert create_us[-1] < 1000, create_us[-5:]


@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_unordered_control_sees_stale_data(framework):
    producer = torch_producer if framework == "torch" else cupy_producer
    ok, _, _ = handoff_trials(producer, framework, False, CONTROL_TRIALS)
    print(f"\n{framework} control: {ok.count(False)}/{len(ok)} trials read stale data")
    assert not all(ok), "the test cannot see a missing wait"


def test_ordered_handoff_to_another_gpu():
    try:
        usmipc.Device("cuda:gpu:1")
    except Exception:
        pytest.skip("one GPU only")
    ok, _, running = handoff_trials(torch_producer, "torch", True, 20, gpu=1)
    assert all(ok) and all(running)


def test_event_handle_cross_process_on_gpu():
    """An explicit Event shared by its handle: the consumer's stream waits."""
    torch = pytest.importorskip("torch")
    x = torch.zeros(N, dtype=torch.int32, device="cuda:0")
    h = IPCMemoryHandle(x, ordered=False)
    ev = usmipc.Event(GPU)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1980000 * SLEEP_MS))
    x.fill_(7)
    ev.record(torch.cuda.current_stream())
    eraw = usmipc.IPCEventHandle(ev).to_bytes()
    code = textwrap.dedent("""
        import sys, torch, usmipc
        from usmipc.memory import IPCMemoryHandle
        raw, eraw = [bytes.fromhex(s) for s in sys.stdin.read().split()]
        ev = usmipc.IPCEventHandle.open(eraw)
        s = torch.cuda.Stream()
        m = IPCMemoryHandle.open(raw, None, ordered=False)
        ev.wait(s)
        with torch.cuda.stream(s):
            print(int(torch.from_dlpack(m).view(torch.int32)[-1].cpu()))
        ev.synchronize()
        assert ev.query()
    """)
    p = subprocess.run([sys.executable, "-c", code],
                       input=h.to_bytes().hex() + " " + eraw.hex(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "7"


def test_wait_on_event_of_killed_exporter():
    """A consumer waiting on the host for an event whose exporter is killed
    mid-kernel gets EEXPORTERGONE, not a hang."""
    code = textwrap.dedent("""
        import sys, torch, usmipc
        ev = usmipc.Event(usmipc.Device("cuda:gpu:0"))
        torch.cuda._sleep(int(1980000 * 20000))  # 20 s
        ev.record(torch.cuda.current_stream())
        sys.stdout.write(usmipc.IPCEventHandle(ev).to_bytes().hex() + "\\n")
        sys.stdout.flush()
        sys.stdin.read()
    """)
    exporter = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    eraw = bytes.fromhex(exporter.stdout.readline().strip())
    waiter = textwrap.dedent("""
        import sys, time, usmipc
        ev = usmipc.IPCEventHandle.open(bytes.fromhex(sys.argv[1]))
        print("opened", flush=True)
        t0 = time.time()
        try:
            ev.synchronize()
            print("completed")
        except usmipc.Error as e:
            print(e.name, round(time.time() - t0, 1))
    """)
    w = subprocess.Popen([sys.executable, "-c", waiter, eraw.hex()],
                         stdout=subprocess.PIPE, text=True)
    assert w.stdout.readline().strip() == "opened"
    time.sleep(1)
    exporter.kill()
    exporter.wait()
    out, _ = w.communicate(timeout=60)
    assert out.startswith("USMIPC_EEXPORTERGONE"), out


def test_release_signal_orders_producer_after_consumer():
    """The consumer writes on its stream after a long kernel and returns
    its release ticket at once (no synchronize); the producer's
    wait_released(stream) makes its stream wait on the device for that
    work, so its read sees the consumer's write every time."""
    torch = pytest.importorskip("torch")
    x = torch.zeros(N, dtype=torch.int32, device="cuda:0")
    h = IPCMemoryHandle(x, release=True)
    consumer = textwrap.dedent("""
        import sys, torch, usmipc
        from usmipc.memory import IPCMemoryHandle
        s = torch.cuda.Stream()
        for line in sys.stdin:
            raw = bytes.fromhex(line.strip())
            m = IPCMemoryHandle.open(raw, None, stream=s)
            with torch.cuda.stream(s):
                y = torch.from_dlpack(m).view(torch.int32)
                torch.cuda._sleep(int(1980000 * 100))   # ~100 ms
                y.fill_(y[0] + 1)
            IPCMemoryHandle.release(m, stream=s)       # no synchronize
            print("released", flush=True)
            s.synchronize()
            del y
            IPCMemoryHandle.close_mapping(m)
    """)
    p = subprocess.Popen([sys.executable, "-c", consumer], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        ps = torch.cuda.current_stream()
        for trial in range(10):
            x.fill_(trial * 10)
            p.stdin.write(h.to_bytes().hex() + "\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "released"
            t0 = time.perf_counter()
            h.wait_released(stream=ps)          # returns at once: device wait
            waited = time.perf_counter() - t0
            assert int(x[0].item()) == trial * 10 + 1, trial
            assert waited < 0.05, waited
        assert h.releases == (10, 10)
    finally:
        p.stdin.close()
        p.wait(timeout=60)


def test_idle_stream_reuses_a_completed_record():
    """A handoff from an idle stream names a completed record and records
    nothing; from a busy one it records, and an open that waits on the host
    returns only once the work before the handoff finished (the stream is
    idle then). Without the record a reused one would return at once."""
    torch = pytest.importorskip("torch")
    x = torch.ones(1 << 20, device="cuda:0")
    h = IPCMemoryHandle(x)
    h.to_bytes()
    torch.cuda.synchronize()
    usmipc.reset_stats()
    raws = [h.to_bytes() for _ in range(20)]
    assert usmipc.stats()["event_records"] == 0, usmipc.stats()
    assert len(set(raws)) == 1
    # Opened on a stream: the record is complete, so nothing is put on it.
    side = torch.cuda.Stream()
    m = IPCMemoryHandle.open(raws[0], GPU, stream=side)
    IPCMemoryHandle.close_mapping(m)
    assert usmipc.stats()["event_waits"] == 0, usmipc.stats()
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(int(3e8))  # ~150-200 ms of GPU time
    x.fill_(7)
    t0 = time.monotonic()
    raw = h.to_bytes()
    assert time.monotonic() - t0 < 0.05, "the handoff synchronized the host"
    assert usmipc.stats()["event_records"] == 1, usmipc.stats()
    assert not stream.query(), "the sleep finished before the open: too short"
    m = IPCMemoryHandle.open(raw, GPU, stream=side)  # a wait on the device
    IPCMemoryHandle.close_mapping(m)
    assert usmipc.stats()["event_waits"] == 1, usmipc.stats()
    m = IPCMemoryHandle.open(raw, GPU)  # the host waits for the record
    assert stream.query(), "the open returned before the producer's work"
    assert int(x[-1]) == 7
    IPCMemoryHandle.close_mapping(m)
    # Idle again: the record just made is reused once known complete.
    before = usmipc.stats()["event_records"]
    for _ in range(5):
        h.to_bytes()
    assert usmipc.stats()["event_records"] == before
