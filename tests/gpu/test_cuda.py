"""The CUDA backend on a real GPU: cross-process sharing for both allocation
kinds, foreign torch and CuPy memory (through __cuda_array_interface__ or only
__dlpack__), DLPack and CUDA array interface interop,
lifetime, bad handles and cross-GPU opens.

Runs only where a CUDA device is present (tests/gpu/run.sh on the device
machine); everything skips elsewhere. Every cross-process test starts a
separate interpreter (subprocess), never a fork of a CUDA-initialised process.
"""
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest

usmipc = pytest.importorskip("usmipc")
from usmipc.memory import (IPCMemoryHandle, MemoryIPCDevice, MemoryUSMDevice,  # noqa: E402
                           MemoryUSMHost, MemoryUSMShared)

try:
    GPU = usmipc.Device("cuda:gpu:0")
except Exception as exc:  # pragma: no cover - CPU machines
    pytestmark = pytest.mark.skip(reason=f"no CUDA device: {exc}")
    GPU = None

KINDS = ["fd", "native"]
N = 1 << 20


def child(code, stdin=b"", env=None, timeout=120):
    """Runs code in a fresh interpreter; returns CompletedProcess."""
    prelude = textwrap.dedent("""
        import sys, os, pickle
        import usmipc
        from usmipc.memory import IPCMemoryHandle
        raw = sys.stdin.buffer.read()
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          input=stdin, capture_output=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def pattern(n, seed=1):
    return bytes((i * 7 + seed) & 0xFF for i in range(n))


def check(proc):
    assert proc.returncode == 0, proc.stderr.decode() + proc.stdout.decode()
    return proc.stdout.decode()


def device_mem(n, kind):
    return MemoryUSMDevice(n, device=GPU, ipc=kind)


# ---- devices ------------------------------------------------------------------

def test_cuda_device_properties():
    assert GPU.backend == "cuda"
    assert GPU.device_type == "gpu"
    assert len(GPU.uuid) == 16 and any(GPU.uuid)
    assert GPU.has_aspect_ipc_memory
    assert GPU.filter_string == "cuda:gpu:0"
    assert usmipc.Device().backend == "cuda"  # the default device is the first GPU


# ---- cross-process, both allocation kinds ------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("transport", ["auto", "socket", "pidfd"])
def test_cross_process_roundtrip(kind, transport):
    if kind == "native" and transport != "auto":
        pytest.skip("native handles carry no file descriptor")
    mem = device_mem(N, kind)
    mem.copy_from_host(pattern(N))
    h = IPCMemoryHandle(mem)
    out = check(child("""
        m = IPCMemoryHandle.open(raw, usmipc.Device("cuda:gpu:0"))
        data = bytes(m.copy_to_host())
        assert data == bytes((i * 7 + 1) & 0xFF for i in range(len(data))), "pattern"
        m.copy_from_host(bytes((i * 7 + 2) & 0xFF for i in range(m.nbytes)))
        n = m.nbytes  # 0 once closed (dpctl's MemoryIPCDevice)
        IPCMemoryHandle.close_mapping(m)
        print("child ok", n)
    """, h.to_bytes(), env={"USMIPC_FD_TRANSPORT": transport}))
    assert f"child ok {N}" in out
    assert bytes(mem.copy_to_host()) == pattern(N, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_interior_pointer_and_size_checks(kind):
    mem = device_mem(N, kind)
    mem.copy_from_host(pattern(N))
    off = 12345
    h = IPCMemoryHandle(mem, offset=off, nbytes=4096)
    out = check(child(f"""
        m = IPCMemoryHandle.open(raw, None)
        assert m.nbytes == 4096
        assert bytes(m.copy_to_host()) == bytes((i * 7 + 1) & 0xFF for i in range({off}, {off} + 4096))
        try:
            IPCMemoryHandle.open(raw, None, nbytes=4097)
        except ValueError as e:
            print("refused:", e)
    """, h.to_bytes()))
    assert "refused:" in out


@pytest.mark.parametrize("kind", KINDS)
def test_same_process_open_is_alias(kind):
    mem = device_mem(4096, kind)
    m2 = IPCMemoryHandle.open(IPCMemoryHandle(mem).to_bytes(), GPU)
    assert m2._pointer == mem._pointer
    IPCMemoryHandle.close_mapping(m2)


def test_native_handle_opened_by_another_library_first():
    """A legacy handle that CuPy opened in the importer first: usmipc opens
    it too (the driver, 580 on the H200, maps it for both), both see the
    exporter's bytes, and usmipc's mapping outlives CuPy's close."""
    cupy = pytest.importorskip("cupy")
    mem = device_mem(4096, "native")
    mem.copy_from_host(pattern(4096, 9))
    raw = IPCMemoryHandle(mem, ordered=False).to_bytes()
    out = check(child("""
        import struct, cupy
        assert struct.unpack_from("<H", raw, 208)[0] == 64  # a CUipcMemHandle
        p = cupy.cuda.runtime.ipcOpenMemHandle(raw[212:212 + 64])
        theirs = cupy.ndarray((4096,), cupy.uint8,
                              cupy.cuda.MemoryPointer(
                                  cupy.cuda.UnownedMemory(p, 4096, None), 0))
        m = IPCMemoryHandle.open(raw, usmipc.Device("cuda:gpu:0"),
                                 ordered=False)
        want = bytes((i * 7 + 9) & 0xFF for i in range(4096))
        assert bytes(theirs.get()) == want, "CuPy's mapping"
        assert bytes(m.copy_to_host()) == want, "usmipc's mapping"
        cupy.cuda.runtime.ipcCloseMemHandle(p)
        assert bytes(m.copy_to_host()) == want, "after CuPy's close"
        print("both mappings ok", m.nbytes)
        IPCMemoryHandle.close_mapping(m)
    """, raw))
    assert "both mappings ok 4096" in out, out


def test_host_and_managed_memory_refused():
    for cls in (MemoryUSMHost, MemoryUSMShared):
        with pytest.raises(TypeError):
            IPCMemoryHandle(cls(4096, device=GPU))


# ---- foreign memory: torch and CuPy ------------------------------------------

def test_torch_tensor_shared_and_read_back_with_torch():
    torch = pytest.importorskip("torch")
    t = torch.arange(1 << 16, dtype=torch.float32, device="cuda:0")
    view = t[100:]  # an interior pointer of the caching allocator's block
    h = IPCMemoryHandle(view)
    out = check(child("""
        import torch
        m = IPCMemoryHandle.open(raw, None)
        x = torch.from_dlpack(m).view(torch.float32)
        expect = torch.arange(100, 1 << 16, dtype=torch.float32, device="cuda:0")
        assert torch.equal(x, expect), "torch data"
        x.mul_(2)
        torch.cuda.synchronize()
        del x
        IPCMemoryHandle.close_mapping(m)
        print("torch ok")
    """, h.to_bytes()))
    assert "torch ok" in out
    torch.cuda.synchronize()
    assert torch.equal(t[100:], torch.arange(100, 1 << 16, dtype=torch.float32,
                                             device="cuda:0") * 2)
    assert torch.equal(t[:100], torch.arange(100, dtype=torch.float32, device="cuda:0"))


class DLPackOnly:
    """Exposes only __dlpack__ of a tensor, as a JAX array does (a torch
    tensor alone would be exported through __cuda_array_interface__)."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, **kwargs):
        return self.t.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def test_torch_tensor_shared_through_dlpack_only():
    torch = pytest.importorskip("torch")
    t = torch.arange(1 << 16, dtype=torch.float32, device="cuda:0")
    torch.cuda.synchronize()  # __dlpack__() without a stream does not sync
    h = IPCMemoryHandle(DLPackOnly(t[100:]))
    assert h.nbytes == ((1 << 16) - 100) * 4
    out = check(child("""
        import torch
        m = IPCMemoryHandle.open(raw, None)
        x = torch.from_dlpack(m).view(torch.float32)
        expect = torch.arange(100, 1 << 16, dtype=torch.float32, device="cuda:0")
        assert torch.equal(x, expect), "torch data"
        x.add_(1)
        torch.cuda.synchronize()
        del x
        IPCMemoryHandle.close_mapping(m)
        print("dlpack ok")
    """, h.to_bytes()))
    assert "dlpack ok" in out
    assert torch.equal(t[100:], torch.arange(101, (1 << 16) + 1, dtype=torch.float32,
                                             device="cuda:0"))
    with pytest.raises(ValueError, match="contiguous"):
        IPCMemoryHandle(DLPackOnly(t.view(256, 256)[:, :8]))
    with pytest.raises(TypeError):
        IPCMemoryHandle(DLPackOnly(torch.arange(16)))  # CPU memory
    del h  # runs torch's deleter; the tensor stays usable
    assert float(t[100]) == 101


def test_cupy_array_shared_and_read_back_with_cupy():
    cp = pytest.importorskip("cupy")
    a = cp.arange(1 << 16, dtype=cp.int32)
    h = IPCMemoryHandle(a)
    out = check(child("""
        import cupy as cp
        m = IPCMemoryHandle.open(raw, None)
        x = cp.from_dlpack(m).view(cp.int32)
        assert bool((x == cp.arange(1 << 16, dtype=cp.int32)).all()), "cupy data"
        x += 1
        cp.cuda.runtime.deviceSynchronize()
        del x
        IPCMemoryHandle.close_mapping(m)
        print("cupy ok")
    """, h.to_bytes()))
    assert "cupy ok" in out
    assert bool((a == cp.arange(1, (1 << 16) + 1, dtype=cp.int32)).all())


def test_dlpack_and_cuda_array_interface_are_zero_copy():
    torch = pytest.importorskip("torch")
    cp = pytest.importorskip("cupy")
    mem = MemoryUSMDevice(4096, device=GPU)
    mem.memset(0)
    cai = mem.__cuda_array_interface__
    assert cai["data"][0] == mem._pointer and cai["version"] == 3
    assert mem.__dlpack_device__() == (2, 0)  # kDLCUDA, device 0
    t = torch.from_dlpack(mem)
    assert t.data_ptr() == mem._pointer and t.numel() == 4096
    t.fill_(7)
    torch.cuda.synchronize()
    assert bytes(mem.copy_to_host()) == b"\x07" * 4096
    c = cp.asarray(mem)  # via __cuda_array_interface__
    assert c.data.ptr == mem._pointer
    del t, c


def test_dlpack_capsule_keeps_mapping_alive():
    torch = pytest.importorskip("torch")
    mem = device_mem(4096, "fd")
    mem.copy_from_host(pattern(4096))
    h = IPCMemoryHandle(mem)
    out = check(child("""
        import torch
        m = IPCMemoryHandle.open(raw, None)
        t = torch.from_dlpack(m)
        IPCMemoryHandle.close_mapping(m)    # the tensor still holds the mapping
        assert m.is_closed
        del m
        import gc; gc.collect()
        assert bytes(t.cpu().numpy()) == bytes((i * 7 + 1) & 0xFF for i in range(4096))
        print("alive ok")
    """, h.to_bytes()))
    assert "alive ok" in out


# ---- lifetime -----------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_exporter_killed_while_importer_reads(kind):
    size = 64 << 20
    exporter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time, usmipc
        from usmipc.memory import MemoryUSMDevice, IPCMemoryHandle
        m = MemoryUSMDevice({size}, device=usmipc.Device("cuda:gpu:0"), ipc="{kind}")
        m.copy_from_host(bytes(range(256)) * ({size} // 256))
        h = IPCMemoryHandle(m)
        sys.stdout.buffer.write(h.to_bytes().hex().encode() + b"\\n")
        sys.stdout.flush()
        time.sleep(600)
    """)], stdout=subprocess.PIPE)
    try:
        raw = bytes.fromhex(exporter.stdout.readline().decode())
        m = IPCMemoryHandle.open(raw, GPU)
        expect = bytes(range(256)) * (size // 256)
        assert bytes(m.copy_to_host()) == expect
        exporter.send_signal(signal.SIGKILL)
        exporter.wait(timeout=30)
        time.sleep(0.5)
        intact = bytes(m.copy_to_host()) == expect
        print(f"{kind}: importer data intact after exporter SIGKILL: {intact}")
        assert intact
        IPCMemoryHandle.close_mapping(m)
        # a new open after the exporter's death fails clearly
        IPCMemoryHandle.set_cache_size(0) if hasattr(IPCMemoryHandle, "set_cache_size") else None
        with pytest.raises((usmipc.Error, ValueError)) as err:
            m3 = IPCMemoryHandle.open(raw, GPU)
            IPCMemoryHandle.close_mapping(m3)
            raise usmipc.Error("reopen after death unexpectedly worked (cached)")
        print(f"{kind}: open after exporter death: {err.value}")
    finally:
        if exporter.poll() is None:
            exporter.kill()


@pytest.mark.parametrize("kind", KINDS)
def test_importer_after_exporter_frees(kind):
    """Measured and recorded: what an importer sees after the exporter frees."""
    script = textwrap.dedent(f"""
        import sys, usmipc
        from usmipc.memory import MemoryUSMDevice, IPCMemoryHandle
        m = MemoryUSMDevice(1 << 20, device=usmipc.Device("cuda:gpu:0"), ipc="{kind}")
        m.copy_from_host(b"\\xab" * (1 << 20))
        h = IPCMemoryHandle(m)
        sys.stdout.buffer.write(h.to_bytes().hex().encode() + b"\\n"); sys.stdout.flush()
        sys.stdin.readline()          # importer has opened
        del h, m                      # free the allocation
        import gc; gc.collect()
        sys.stdout.write("freed\\n"); sys.stdout.flush()
        sys.stdin.readline()
    """)
    exporter = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)
    try:
        raw = bytes.fromhex(exporter.stdout.readline().decode())
        m = IPCMemoryHandle.open(raw, GPU)
        exporter.stdin.write(b"go\n"); exporter.stdin.flush()
        assert exporter.stdout.readline() == b"freed\n"
        data = bytes(m.copy_to_host())
        intact = data == b"\xab" * (1 << 20)
        print(f"{kind}: importer data intact after exporter free: {intact}")
        if kind == "fd":
            assert intact, "fd-shared memory must outlive the exporter's free"
        IPCMemoryHandle.close_mapping(m)
    finally:
        exporter.stdin.write(b"bye\n"); exporter.stdin.flush()
        exporter.wait(timeout=30)


# ---- bad handles --------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_bad_handles(kind):
    mem = device_mem(4096, kind)
    raw = IPCMemoryHandle(mem).to_bytes()
    with pytest.raises(ValueError):
        IPCMemoryHandle.open(raw[:-1], GPU)
    flipped = bytearray(raw)
    flipped[70] ^= 0x10
    with pytest.raises(ValueError):
        IPCMemoryHandle.open(bytes(flipped), GPU)
    with pytest.raises(ValueError):
        IPCMemoryHandle.open(raw, GPU, nbytes=4097)
    with pytest.raises(ValueError):  # a CUDA handle opened on the host device
        IPCMemoryHandle.open(raw, usmipc.Device("host:cpu"))


@pytest.mark.parametrize("kind", KINDS)
def test_open_where_no_gpu_is_visible(kind):
    """An importer that CUDA_VISIBLE_DEVICES leaves without a GPU gets an
    error that says so (and why the backend has no device), not advice to
    name a GPU it does not have, and not a crash."""
    mem = device_mem(4096, kind)
    out = check(child("""
        try:
            IPCMemoryHandle.open(raw)
        except usmipc.Error as e:
            print(e.name, "|", e)
        else:
            print("opened")
        try:
            IPCMemoryHandle.open(raw, usmipc.Device("host"))
        except usmipc.Error as e:
            print(e.name, "|", e)
    """, IPCMemoryHandle(mem).to_bytes(), env={"CUDA_VISIBLE_DEVICES": ""}))
    first, second = out.strip().splitlines()[-2:]
    assert first.startswith("USMIPC_EUNAVAILABLE |"), out
    assert "this process has no cuda device" in first, out
    assert "CUDA_VISIBLE_DEVICES" in first, out
    assert second.startswith("USMIPC_EWRONGDEVICE |"), out


# ---- across GPUs --------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_open_on_another_gpu(kind):
    try:
        gpu1 = usmipc.Device("cuda:gpu:1")
    except Exception:
        pytest.skip("one GPU only")
    mem = device_mem(N, kind)
    mem.copy_from_host(pattern(N))
    out = check(child("""
        import cupy as cp
        m = IPCMemoryHandle.open(raw, usmipc.Device("cuda:gpu:1"))
        assert bytes(m.copy_to_host()) == bytes((i * 7 + 1) & 0xFF for i in range(m.nbytes))
        with cp.cuda.Device(1):
            x = cp.from_dlpack(m)
            x += 1
            cp.cuda.runtime.deviceSynchronize()
            del x
        IPCMemoryHandle.close_mapping(m)
        print("gpu1 ok")
    """, IPCMemoryHandle(mem).to_bytes()))
    assert "gpu1 ok" in out
    assert bytes(mem.copy_to_host()) == bytes(((i * 7 + 1) + 1) & 0xFF for i in range(N))


# ---- revocation of framework memory and bounded idle mappings (issue 7) -------

def test_torch_tensor_revoked_when_its_last_handle_dies():
    """A tensor exported by pointer has an export-table slot held by its
    handles: once the last IPCMemoryHandle is gone the old bytes are refused,
    also after the caching allocator hands the same memory to a new tensor
    (before, a stale handle opened the new tensor's data)."""
    torch = pytest.importorskip("torch")
    import gc
    t = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    ptr = t.data_ptr()
    h = IPCMemoryHandle(t)
    raw = h.to_bytes()
    opener = """
        try:
            m = IPCMemoryHandle.open(raw, usmipc.Device("cuda:gpu:0"), nbytes=16)
            print("opened", bytes(m.copy_to_host())[0])
        except usmipc.Error as e:
            print("refused", e.name)
    """
    assert "opened 7" in check(child(opener, raw))
    del h
    gc.collect()
    assert "refused USMIPC_EEXPORTERGONE" in check(child(opener, raw))
    del t
    u = torch.full((1 << 20,), 9, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    reused = u.data_ptr() == ptr
    assert "refused USMIPC_EEXPORTERGONE" in check(child(opener, raw))
    # A new handle of the new tensor works.
    h2 = IPCMemoryHandle(u)
    assert "opened 9" in check(child(opener, h2.to_bytes()))
    print("address reused by the new tensor:", reused)


def _device_used_bytes():
    free, total = GPU_MEM_INFO()
    return total - free


def GPU_MEM_INFO():
    cupy = pytest.importorskip("cupy")
    return cupy.cuda.runtime.memGetInfo()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["defaults", "drop-on-free", "byte-cap"])
def test_streamed_1gib_buffers_do_not_pin_device_memory(kind, mode):
    """A producer streams 40 fresh 1 GiB buffers (allocate, export, the
    consumer opens, reads, closes, the producer frees). The consumer's idle
    cache must not keep freed device memory: device memory in use stays
    within two buffers of the start. defaults: the cache's own policy (no
    count or byte bound on mappings of live exports; freed ones dropped);
    drop-on-free: the byte cap is set above the stream's total, so only
    dropping the mappings of freed allocations can hold it; byte-cap:
    dropping is off and a 2 GiB cap alone holds it."""
    import gc
    gib = 1 << 30
    env = {"USMIPC_IPC_CACHE_SIZE": "1000"}
    if mode == "defaults":
        env = {}
    elif mode == "drop-on-free":
        env["USMIPC_IPC_CACHE_BYTES"] = str(1 << 40)
    else:
        env["USMIPC_IPC_CACHE_DROP_FREED"] = "0"
        env["USMIPC_IPC_CACHE_BYTES"] = str(2 * gib)
    consumer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, usmipc, usmipc.memory
            from usmipc.memory import IPCMemoryHandle
            dev = usmipc.Device("cuda:gpu:0")
            usmipc.memory.MemoryUSMDevice(4096, device=dev).memset(0)  # context up
            print("ready", flush=True)
            for line in sys.stdin:
                m = IPCMemoryHandle.open(bytes.fromhex(line.strip()), dev, nbytes=16)
                first = bytes(m.copy_to_host())[0]
                IPCMemoryHandle.close_mapping(m)
                print(first, flush=True)
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, **env))
    try:
        assert consumer.stdout.readline().strip() == "ready"
        gc.collect()
        base = _device_used_bytes()
        worst = 0
        for i in range(40):
            mem = device_mem(gib, kind)
            mem.memset(i + 1)
            consumer.stdin.write(IPCMemoryHandle(mem).to_bytes().hex() + "\n")
            consumer.stdin.flush()
            assert consumer.stdout.readline().strip() == str(i + 1)
            del mem
            gc.collect()
            worst = max(worst, _device_used_bytes() - base)
        print(f"{kind} {mode}: worst extra device memory {worst / gib:.2f} GiB")
        assert worst <= 2 * gib + (256 << 20), f"{worst / gib:.2f} GiB pinned"
    finally:
        consumer.stdin.close()
        consumer.wait(timeout=60)


@pytest.mark.parametrize("drop", ["default", "off"])
def test_freed_segment_leaves_the_consumers_cache_within_a_second(drop):
    """A producer shares a torch tensor (PyTorch's caching allocator) in a
    bundle; a consumer opens and closes it (its mapping stays idle in the
    import cache, warm for the next handoff); then the producer drops the
    bundle and the tensor and calls torch.cuda.empty_cache(). The export
    goes with its last holder, and the consumer's cache drops the idle
    mapping within a second with no call from the consumer (its sweeper),
    so the segment's device memory is free again; the old bytes open no
    more. drop="off" (USMIPC_IPC_CACHE_DROP_FREED=0, no dropping, no
    sweeper) shows what the sweeper buys: the consumer's idle mapping keeps
    the memory."""
    torch = pytest.importorskip("torch")
    env = {} if drop == "default" else {"USMIPC_IPC_CACHE_DROP_FREED": "0"}
    consumer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, torch, usmipc
            dev = usmipc.Device("cuda:gpu:0")
            print("ready", flush=True)
            for line in sys.stdin:
                try:
                    tree = usmipc.open_shared(bytes.fromhex(line.strip()),
                                              device=dev)
                    first = int(torch.from_dlpack(tree["t"])[0])
                    usmipc.close_shared(tree)
                    print("opened", first, flush=True)
                except usmipc.Error as e:
                    print(e.name, flush=True)
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, **env))
    try:
        assert consumer.stdout.readline().strip() == "ready"
        t = torch.full((256 << 20,), 7, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        bundle = usmipc.share({"t": t})
        raw = bundle.to_bytes().hex()
        consumer.stdin.write(raw + "\n")
        consumer.stdin.flush()
        assert consumer.stdout.readline().split() == ["opened", "7"]
        free_before = torch.cuda.mem_get_info()[0]
        del t, bundle
        torch.cuda.empty_cache()
        time.sleep(1.2)
        back = (torch.cuda.mem_get_info()[0] - free_before) >> 20
        consumer.stdin.write(raw + "\n")
        consumer.stdin.flush()
        again = consumer.stdout.readline().strip()
        print(f"drop={drop}: {back} MiB back after 1.2 s; the old bytes "
              f"again: {again}")
        assert again == "USMIPC_EEXPORTERGONE", again
        if drop == "default":
            assert back >= 250, f"only {back} MiB of 256 came back"
    finally:
        consumer.stdin.close()
        consumer.wait(30)
