#!/usr/bin/env python3
"""CUDA IPC side by side: usmipc (fd and native) against CuPy, PyTorch and cuda.core.

Every system runs in its own producer process (started with subprocess, so
this driver never initialises CUDA); each producer starts its consumer with
multiprocessing's *spawn* context (never fork after CUDA init), allocates K
fresh buffers per size, exports them, and keeps them alive until the consumer
has reported. The consumer opens every handle once (a true first open), reads
the first imported buffer with device-to-device copies (CUDA events), times
re-opens of an already-open handle, and closes everything.

    python3 bench/bench_cuda.py [--sizes 4K,1M,256M,1G] [--k 40]
        [--systems usmipc-fd,usmipc-native,cupy,torch,cuda.core,staged]
        [--json out.json] [--plot out.png]
    python3 bench/bench_cuda.py --selftest    # no GPU needed

Prints Markdown tables (rows: systems, columns: sizes) of medians; --json
writes everything (p10/p90/min/first sample, notes, errors); --plot draws
export and first-open latency against size. A system that fails is reported
as "n/a: <error>" and the others still run.
"""
import argparse
import datetime
import gc
import json
import os
import pickle
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = "4K,1M,256M,1G"
PATTERN = 0x5A           # byte the producer writes into buffer 0; the consumer checks it
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

# key -> row label (order = row order)
SYSTEMS = {
    "usmipc-fd": "usmipc (fd / VMM)",
    "usmipc-native": "usmipc (native / legacy)",
    "cupy": "CuPy raw cudaIpc*",
    "torch": "PyTorch reduce_tensor",
    "cuda.core": "cuda.core mempool IPC",
    "staged": "host-staged copy (D2H+shm+H2D)",
}
# not in the default run: host shared memory standing in for a GPU system, so
# that --selftest can drive the real producer/consumer machinery without CUDA
HIDDEN_SYSTEMS = {"mock": "mock (host shm; selftest only)"}
ALIASES = {"usmipc": ["usmipc-fd", "usmipc-native"], "all": list(SYSTEMS),
           "cuda_core": ["cuda.core"], "cudacore": ["cuda.core"],
           "pytorch": ["torch"], "host-staged": ["staged"]}


# ---- small helpers (no GPU) --------------------------------------------------

def parse_size(text):
    """'4K', '4KiB', '1M', '1G', '4096' -> bytes."""
    s = text.strip().upper().replace("IB", "").rstrip("B")
    mult = 1
    if s and s[-1] in "KMGT":
        mult = {"K": KiB, "M": MiB, "G": GiB, "T": 1 << 40}[s[-1]]
        s = s[:-1]
    value = int(float(s) * mult)
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


def parse_sizes(text):
    return [parse_size(t) for t in text.split(",") if t.strip()]


def fmt_size(n):
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def parse_systems(text):
    out = []
    for t in (x.strip() for x in text.split(",")):
        if not t:
            continue
        keys = ALIASES.get(t, [t])
        for k in keys:
            if k not in SYSTEMS and k not in HIDDEN_SYSTEMS:
                raise ValueError(f"unknown system {t!r}; known: {', '.join(SYSTEMS)}")
            if k not in out:
                out.append(k)
    return out


def summary(samples):
    if not samples:
        return None
    s = sorted(samples)
    n = len(s)
    return {
        "median": statistics.median(s),
        "p10": s[max(0, (n + 9) // 10 - 1)],
        "p90": s[min(n - 1, (9 * n) // 10)],
        "min": s[0],
        "max": s[-1],
        "mean": statistics.fmean(s),
        "first": samples[0],       # the very first call (cold caches) in call order
        "n": n,
    }


def us(t0, t1):
    return (t1 - t0) * 1e6


def errstr(e):
    text = f"{type(e).__name__}: {e}".strip()
    return " ".join(text.split())[:600]


def _label(system):
    return SYSTEMS.get(system) or HIDDEN_SYSTEMS.get(system, system)


def k_for(size, cfg, system):
    k = cfg["k_large"] if size >= cfg["large_threshold"] else cfg["k"]
    if system == "staged":
        k = min(k, cfg["staged_k"])
    return max(1, k)


def log(msg):
    sys.stderr.write(f"[bench_cuda {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def _import_usmipc():
    """Import usmipc; fall back to the source tree's python/ (an in-place build)."""
    try:
        import usmipc
    except ImportError:
        here = os.path.dirname(os.path.abspath(__file__))
        src = os.path.join(os.path.dirname(here), "python")
        if src not in sys.path:
            sys.path.insert(0, src)
        import usmipc
    return usmipc


def _cupy(required=True):
    try:
        import cupy
        return cupy
    except Exception:
        if required:
            raise
        return None


# ---- adapters: one per system, producer and consumer side --------------------

class SizeSkipped(Exception):
    """This system does not run at this size (reported as n/a, not an error)."""


class Adapter:
    repeat_supported = True     # repeated export of the same buffer makes sense
    keep_repeat_payloads = False  # send the repeated exports along (torch: ref counters)
    reopen_supported = True     # "open again while open" makes sense
    reopen_note = ""
    bw_supported = True

    def __init__(self, cfg):
        self.cfg = cfg
        self.dev_index = cfg["device"]
        self.info = {}
        self.notes = []

    # producer
    def p_setup(self):
        pass

    def p_begin_size(self, size, k):
        return {}, {}           # (timings for the results, extra payload for the consumer)

    def p_alloc(self, size):
        raise NotImplementedError

    def p_ptr(self, buf):
        raise NotImplementedError

    def p_sync(self):
        cp = _cupy(required=False)
        if cp is not None:
            cp.cuda.runtime.deviceSynchronize()

    def p_fill(self, buf, size, value):
        cp = _cupy()
        cp.cuda.runtime.memset(self.p_ptr(buf), value, size)

    def p_export(self, buf):
        raise NotImplementedError

    def p_distinct_key(self, payload):
        return None

    def p_free(self, bufs):
        bufs.clear()
        gc.collect()

    # consumer
    def c_setup(self):
        pass

    def c_begin_size(self, extra):
        return {}

    def c_open(self, payload, size):
        raise NotImplementedError   # -> (object keeping the mapping, int device pointer)

    def c_close(self, holder):
        holder.clear()

    def c_end_size(self):
        gc.collect()


class UsmipcAdapter(Adapter):
    def __init__(self, cfg, kind):
        super().__init__(cfg)
        self.kind = kind
        self.reopen_note = "open+close of the same handle while it is open (import cache)"

    def _common(self):
        usmipc = _import_usmipc()
        from usmipc.memory import IPCMemoryHandle, MemoryUSMDevice
        self.usmipc = usmipc
        self.IPCMemoryHandle = IPCMemoryHandle
        self.MemoryUSMDevice = MemoryUSMDevice
        self.dev = usmipc.Device(self.cfg.get("usmipc_filter") or f"cuda:gpu:{self.dev_index}")
        self.info["usmipc_version"] = getattr(usmipc, "__version__", "?")
        self.info["usmipc_file"] = getattr(usmipc, "__file__", "?")
        self.info["device"] = f"{getattr(self.dev, 'filter_string', '?')} ({getattr(self.dev, 'name', '?')})"

    def p_setup(self):
        self._common()
        self.keep = []
        env_kind = os.environ.get("USMIPC_CUDA_IPC", "")
        try:
            probe = self.MemoryUSMDevice(4096, device=self.dev, ipc=self.kind)
            del probe
            self.kw = {"ipc": self.kind}
            self.info["kind_selected_by"] = f"MemoryUSMDevice(..., ipc={self.kind!r})"
        except TypeError as e:
            self.kw = {}
            self.info["kind_selected_by"] = (f"env USMIPC_CUDA_IPC={env_kind!r} "
                                             f"(ipc= not accepted: {errstr(e)})")
            if env_kind != self.kind:
                raise RuntimeError(
                    f"ipc= keyword not accepted and USMIPC_CUDA_IPC={env_kind!r} "
                    f"is not {self.kind!r}: cannot select the allocation kind")
        # warm the context and the export path once
        m = self.MemoryUSMDevice(4096, device=self.dev, **self.kw)
        self.IPCMemoryHandle(m).to_bytes()
        del m
        gc.collect()

    def p_alloc(self, size):
        return self.MemoryUSMDevice(size, device=self.dev, **self.kw)

    def p_ptr(self, buf):
        return buf._pointer

    def p_export(self, buf):
        h = self.IPCMemoryHandle(buf)
        raw = h.to_bytes()
        self.keep.append(h)     # the producer keeps its handle objects alive too
        return raw

    def p_export_repeat(self, buf):
        return self.IPCMemoryHandle(buf).to_bytes()

    def p_free(self, bufs):
        self.keep.clear()
        super().p_free(bufs)

    def c_setup(self):
        self._common()

    def c_open(self, payload, size):
        m = self.IPCMemoryHandle.open(payload, self.dev)
        return m, m._pointer

    def c_close(self, holder):
        self.IPCMemoryHandle.close_mapping(holder.pop())


class CupyAdapter(Adapter):
    reopen_note = ("cudaIpcOpenMemHandle + cudaIpcCloseMemHandle on a handle that is "
                   "already open in this process")

    def _common(self):
        cp = _cupy()
        self.cp = cp
        cp.cuda.Device(self.dev_index).use()
        self.rt = cp.cuda.runtime
        self.flags = getattr(self.rt, "cudaIpcMemLazyEnablePeerAccess", 1)
        self.info["cupy_version"] = cp.__version__

    def p_setup(self):
        self._common()
        m = self.cp.cuda.Memory(4096)      # warm the context and the export path
        self.rt.ipcGetMemHandle(m.ptr)
        del m

    def p_alloc(self, size):
        # a fresh cudaMalloc per buffer (cupy.cuda.Memory bypasses the pool),
        # so each handle names its own allocation and the offset is 0
        return self.cp.cuda.Memory(size)

    def p_ptr(self, buf):
        return buf.ptr

    def p_export(self, buf):
        return self.rt.ipcGetMemHandle(buf.ptr)

    def p_distinct_key(self, payload):
        return bytes(payload)

    def c_setup(self):
        self._common()
        self.cp.cuda.Memory(1)   # context init outside the timed region

    def c_open(self, payload, size):
        ptr = self.rt.ipcOpenMemHandle(payload, self.flags)
        return ptr, ptr

    def c_close(self, holder):
        self.rt.ipcCloseMemHandle(holder.pop())


class TorchAdapter(Adapter):
    keep_repeat_payloads = True
    reopen_note = ("rebuild_cuda_tensor(*args) again while the first tensor is alive: "
                   "hits torch.multiprocessing's shared_cache (keyed by handle+offset) "
                   "and releases that send's ref counter")

    def _common(self):
        import torch
        self.torch = torch
        torch.cuda.set_device(self.dev_index)
        torch.cuda.init()
        self.device = torch.device("cuda", self.dev_index)
        self.info["torch_version"] = torch.__version__
        self.info["torch_cuda"] = getattr(torch.version, "cuda", None)
        self.info["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")

    def p_setup(self):
        self._common()
        from torch.multiprocessing.reductions import reduce_tensor
        self.reduce_tensor = reduce_tensor
        x = self.torch.empty(16 * MiB, dtype=self.torch.uint8, device=self.device)
        del x
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()

    def p_begin_size(self, size, k):
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()
        return {}, {}

    def p_alloc(self, size):
        """A tensor alone in its caching-allocator segment.

        The caching allocator packs small tensors into shared 2 MiB segments
        (20 MiB ones for < 10 MiB), and one legacy handle names a whole
        segment: without padding, 40 x 4 KiB tensors share one handle and 39
        of 40 "first" opens are cache hits in the consumer. The pads fill the
        rest of the new segment (small pool: blocks <= 1 MiB; large pool:
        remainders > 1 MiB are split off). distinct_allocations in the
        results says whether it worked.
        """
        torch, u8 = self.torch, self.torch.uint8
        t = torch.empty(size, dtype=u8, device=self.device)
        pads = []
        rounded = 512 if size < 512 else (size + 511) // 512 * 512
        if size <= MiB:
            rest = 2 * MiB - rounded
            while rest > 0:
                c = min(rest, MiB)
                pads.append(torch.empty(c, dtype=u8, device=self.device))
                rest -= c
        else:
            seg = 20 * MiB if size < 10 * MiB else (rounded + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)
            rest = seg - rounded
            if rest > MiB:
                pads.append(torch.empty(rest, dtype=u8, device=self.device))
        return (t, pads)

    def p_ptr(self, buf):
        return buf[0].data_ptr()

    def p_fill(self, buf, size, value):
        buf[0].fill_(value)

    def p_sync(self):
        self.torch.cuda.synchronize()

    def p_export(self, buf):
        return self.reduce_tensor(buf[0])    # (rebuild_cuda_tensor, args): picklable

    def p_distinct_key(self, payload):
        return bytes(payload[1][7])          # storage_handle: names the cudaMalloc segment

    def p_free(self, bufs):
        bufs.clear()
        gc.collect()
        self.torch.cuda.synchronize()
        try:
            self.torch.cuda.ipc_collect()
        except Exception:
            pass
        self.torch.cuda.empty_cache()

    def c_setup(self):
        self._common()
        self.torch.empty(1, device=self.device)

    def c_open(self, payload, size):
        fn, args = payload
        t = fn(*args)
        return t, t.data_ptr()

    def c_close(self, holder):
        holder.clear()          # dropping the last reference closes the mapping

    def c_end_size(self):
        gc.collect()
        self.torch.cuda.synchronize()


class CudaCoreAdapter(Adapter):
    reopen_note = ("Buffer.from_ipc_descriptor(mmr, desc) + close() for a descriptor "
                   "whose buffer is already imported (cuMemPoolImportPointer again)")

    def _common(self):
        try:
            import cuda.core as cc
            cc.DeviceMemoryResource  # noqa: B018  (1.x namespace)
            self.info["cuda_core_namespace"] = "cuda.core"
        except (ImportError, AttributeError):
            import cuda.core.experimental as cc
            self.info["cuda_core_namespace"] = "cuda.core.experimental"
        self.cc = cc
        try:
            from importlib.metadata import version
            self.info["cuda_core_version"] = version("cuda-core")
        except Exception:
            self.info["cuda_core_version"] = getattr(cc, "__version__", "?")
        self.dev = cc.Device(self.dev_index)
        self.dev.set_current()
        self.stream = self.dev.default_stream
        self._close_takes_stream = True
        self._import_takes_stream = True

    def _alloc_handle(self, mr):
        # 1.x: property mr.allocation_handle; 0.4: method mr.get_allocation_handle()
        if hasattr(type(mr), "allocation_handle"):
            h = mr.allocation_handle
            return h() if callable(h) else h
        return mr.get_allocation_handle()

    def _descriptor(self, buf):
        if self._desc_prop:
            return buf.ipc_descriptor
        return buf.get_ipc_descriptor()

    def _close(self, buf):
        if self._close_takes_stream:
            try:
                buf.close(self.stream)
                return
            except TypeError:
                self._close_takes_stream = False
        buf.close()

    def p_setup(self):
        self._common()
        self._desc_prop = hasattr(self.cc.Buffer, "ipc_descriptor")
        self.info["descriptor_api"] = "Buffer.ipc_descriptor" if self._desc_prop else "Buffer.get_ipc_descriptor()"
        self.mr = None

    def p_begin_size(self, size, k):
        cc = self.cc
        gran = 2 * MiB
        per = (size + gran - 1) // gran * gran
        max_size = (k * per + 64 * MiB + gran - 1) // gran * gran
        opts = cc.DeviceMemoryResourceOptions(ipc_enabled=True, max_size=max_size)
        t0 = time.perf_counter()
        self.mr = cc.DeviceMemoryResource(self.dev, opts)
        t1 = time.perf_counter()
        handle = self._alloc_handle(self.mr)
        t2 = time.perf_counter()
        timings = {"pool_create_us": us(t0, t1), "pool_export_us": us(t1, t2),
                   "pool_max_size": max_size}
        # the handle (a POSIX fd) travels through multiprocessing's reduction
        # (DupFd via resource_sharer); plain pickle cannot carry it
        return timings, {"alloc_handle": handle}

    def p_alloc(self, size):
        try:
            return self.mr.allocate(size, stream=self.stream)
        except TypeError:
            return self.mr.allocate(size)

    def p_ptr(self, buf):
        return int(buf.handle)

    def p_sync(self):
        self.dev.sync()

    def p_export(self, buf):
        return self._descriptor(buf)

    def p_free(self, bufs):
        for b in bufs:
            try:
                self._close(b)
            except Exception:
                pass
        bufs.clear()
        self.dev.sync()
        gc.collect()
        if self.mr is not None:
            try:
                self.mr.close()
            except Exception:
                pass
            self.mr = None

    def c_setup(self):
        self._common()
        self.mmr = None

    def c_begin_size(self, extra):
        t0 = time.perf_counter()
        self.mmr = self.cc.DeviceMemoryResource.from_allocation_handle(self.dev, extra["alloc_handle"])
        t1 = time.perf_counter()
        return {"pool_import_us": us(t0, t1)}

    def c_open(self, payload, size):
        Buffer = self.cc.Buffer
        if self._import_takes_stream:
            try:
                buf = Buffer.from_ipc_descriptor(self.mmr, payload, stream=self.stream)
                return buf, int(buf.handle)
            except TypeError:
                self._import_takes_stream = False
        buf = Buffer.from_ipc_descriptor(self.mmr, payload)
        return buf, int(buf.handle)

    def c_close(self, holder):
        self._close(holder.pop())

    def c_end_size(self):
        self.dev.sync()
        gc.collect()
        if self.mmr is not None:
            try:
                self.mmr.close()
            except Exception:
                pass
            self.mmr = None


class StagedAdapter(Adapter):
    """Baseline without IPC: D2H into POSIX shared memory, attach + H2D in the consumer."""
    repeat_supported = False
    reopen_supported = False
    bw_supported = False
    reopen_note = "n/a: every open is a fresh copy"

    def _common(self):
        cp = _cupy()
        self.cp = cp
        cp.cuda.Device(self.dev_index).use()
        self.rt = cp.cuda.runtime
        import numpy as np
        from multiprocessing import shared_memory
        self.np = np
        self.shared_memory = shared_memory

    def p_setup(self):
        self._common()
        self.shms = []

    def p_begin_size(self, size, k):
        if size > self.cfg["staged_max"]:
            raise SizeSkipped(f"skipped: above --staged-max {fmt_size(self.cfg['staged_max'])}")
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
        if size * k > 0.8 * free:
            raise SizeSkipped(f"skipped: /dev/shm has {free // MiB} MiB free, needs {size * k // MiB} MiB")
        return {}, {}

    def p_alloc(self, size):
        return self.cp.cuda.Memory(size)

    def p_ptr(self, buf):
        return buf.ptr

    def p_export(self, buf):
        size = buf.size
        shm = self.shared_memory.SharedMemory(create=True, size=size)
        arr = self.np.frombuffer(shm.buf, dtype=self.np.uint8, count=size)
        self.rt.memcpy(arr.ctypes.data, buf.ptr, size, self.rt.memcpyDeviceToHost)
        del arr
        self.shms.append(shm)
        return (shm.name, size)

    def p_free(self, bufs):
        for shm in self.shms:
            try:
                shm.close()
                shm.unlink()
            except Exception:
                pass
        self.shms.clear()
        super().p_free(bufs)

    def c_setup(self):
        self._common()
        self.cp.cuda.Memory(1)

    def c_open(self, payload, size):
        name, n = payload
        shm = self.shared_memory.SharedMemory(name=name)
        try:   # Python 3.12: attaching registers with the resource tracker; the producer unlinks
            from multiprocessing import resource_tracker
            resource_tracker.unregister(shm._name, "shared_memory")
        except Exception:
            pass
        mem = self.cp.cuda.Memory(n)
        arr = self.np.frombuffer(shm.buf, dtype=self.np.uint8, count=n)
        self.rt.memcpy(mem.ptr, arr.ctypes.data, n, self.rt.memcpyHostToDevice)
        del arr
        self.rt.deviceSynchronize()
        return (shm, mem), mem.ptr

    def c_close(self, holder):
        shm, mem = holder.pop()
        shm.close()
        del mem


class MockAdapter(Adapter):
    """Host shared memory through the same pipeline (selftest only, no CUDA)."""
    bw_supported = False
    reopen_note = "SharedMemory attach + close while attached (mock)"

    def _common(self):
        from multiprocessing import shared_memory
        self.shared_memory = shared_memory

    def p_setup(self):
        self._common()
        self.info["mock"] = True

    def p_alloc(self, size):
        return self.shared_memory.SharedMemory(create=True, size=size)

    def p_ptr(self, buf):
        return 0

    def p_sync(self):
        pass

    def p_fill(self, buf, size, value):
        buf.buf[:16] = bytes([value]) * 16

    def p_export(self, buf):
        return buf.name

    def p_distinct_key(self, payload):
        return payload

    def p_free(self, bufs):
        for b in bufs:
            b.close()
            b.unlink()
        super().p_free(bufs)

    def c_setup(self):
        self._common()

    def c_open(self, payload, size):
        shm = self.shared_memory.SharedMemory(name=payload)
        try:
            from multiprocessing import resource_tracker
            resource_tracker.unregister(shm._name, "shared_memory")
        except Exception:
            pass
        return shm, id(shm)

    def c_close(self, holder):
        holder.pop().close()


def make_adapter(system, cfg):
    if system == "usmipc-fd":
        return UsmipcAdapter(cfg, "fd")
    if system == "usmipc-native":
        return UsmipcAdapter(cfg, "native")
    if system == "cupy":
        return CupyAdapter(cfg)
    if system == "torch":
        return TorchAdapter(cfg)
    if system == "cuda.core":
        return CudaCoreAdapter(cfg)
    if system == "staged":
        return StagedAdapter(cfg)
    if system == "mock":
        return MockAdapter(cfg)
    raise ValueError(system)


# ---- consumer (spawned by the producer) --------------------------------------

def _read_pattern(cp, ptr, size):
    """True if the first and last 16 bytes at ptr hold PATTERN."""
    import numpy as np
    n = min(16, size)
    host = np.zeros(n, dtype=np.uint8)
    rt = cp.cuda.runtime
    rt.memcpy(host.ctypes.data, ptr, n, rt.memcpyDeviceToHost)
    ok = bool((host == PATTERN).all())
    if size > 32:
        rt.memcpy(host.ctypes.data, ptr + size - n, n, rt.memcpyDeviceToHost)
        ok = ok and bool((host == PATTERN).all())
    return ok


class _Owner:
    """Stands in as UnownedMemory's owner: the adapter keeps the mapping alive."""


def _measure_bw(cp, src_ptr, size, dev_index, reps):
    """Device-to-device copy of `size` bytes from src_ptr (imported) and from a
    local buffer into a local buffer; CUDA events; median GB/s."""
    mem = cp.cuda.memory
    src = mem.MemoryPointer(mem.UnownedMemory(src_ptr, size, _Owner(), dev_index), 0)
    local_src_mem = mem.Memory(size)
    local_src = mem.MemoryPointer(local_src_mem, 0)
    dst_mem = mem.Memory(size)
    dst = mem.MemoryPointer(dst_mem, 0)
    stream = cp.cuda.Stream(non_blocking=True)
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    inner = max(1, min(200, (256 * MiB) // size))   # batch tiny copies per event pair

    def run(s):
        for _ in range(3):
            dst.copy_from_device_async(s, size, stream)
        stream.synchronize()
        ms = []
        for _ in range(reps):
            e0.record(stream)
            for _ in range(inner):
                dst.copy_from_device_async(s, size, stream)
            e1.record(stream)
            e1.synchronize()
            ms.append(cp.cuda.get_elapsed_time(e0, e1))
        med = statistics.median(ms)
        return size * inner / (med * 1e-3) / 1e9, ms

    imported, ms_i = run(src)
    local, ms_l = run(local_src)
    stream.synchronize()          # the local buffers are freed when this returns
    return {
        "bw_imported_GBps": imported,
        "bw_local_GBps": local,
        "bw_ratio": imported / local if local else None,
        "bw_copies_per_sample": inner,
        "bw_reps": reps,
        "bw_imported_ms_samples": ms_i,
        "bw_local_ms_samples": ms_l,
    }


def _consumer_job(ad, cp, size, job, cfg):
    res = {}
    try:
        res.update(ad.c_begin_size(job.get("extra") or {}))
    except Exception as e:
        res["error"] = "consumer setup for this size: " + errstr(e)
        return res
    opened, times = [], []
    try:
        for p in job["payloads"]:
            t0 = time.perf_counter()
            obj, ptr = ad.c_open(p, size)
            t1 = time.perf_counter()
            opened.append([obj, ptr])
            times.append(us(t0, t1))
    except Exception as e:
        res["open_error"] = f"after {len(opened)} opens: {errstr(e)}"
    res["open_first"] = summary(times)
    res["opened"] = len(opened)
    if opened:
        ptr0 = opened[0][1]
        if cp is not None and job.get("filled"):
            try:
                res["verified"] = _read_pattern(cp, ptr0, size)
            except Exception as e:
                res["verify_error"] = errstr(e)
        if ad.bw_supported:
            if cp is None:
                res["bw_error"] = "cupy not importable in the consumer"
            else:
                try:
                    res.update(_measure_bw(cp, ptr0, size, ad.dev_index, cfg["bw_reps"]))
                except Exception as e:
                    res["bw_error"] = errstr(e)
        if ad.reopen_supported:
            payload0 = job["payloads"][0]
            extra = job.get("reopen_payloads")
            n = len(extra) if extra else cfg["reopen"]
            t_open, t_pair, same, i = [], [], 0, 0
            try:
                for i in range(n):
                    p = extra[i] if extra else payload0
                    t0 = time.perf_counter()
                    obj, ptr = ad.c_open(p, size)
                    t1 = time.perf_counter()
                    holder = [obj]
                    del obj
                    ad.c_close(holder)
                    t2 = time.perf_counter()
                    t_open.append(us(t0, t1))
                    t_pair.append(us(t0, t2))
                    same += ptr == ptr0
            except Exception as e:
                res["reopen_error"] = f"iteration {i}: {errstr(e)}"
            res["reopen_open"] = summary(t_open)
            res["reopen_pair"] = summary(t_pair)
            res["reopen_same_ptr"] = same
            res["reopen_n"] = len(t_open)
            if cp is not None and job.get("filled"):
                try:
                    res["readable_after_reopen"] = _read_pattern(cp, ptr0, size)
                except Exception as e:
                    res["readable_after_reopen"] = False
                    res["readable_after_reopen_error"] = errstr(e)
        closes = []
        try:
            for entry in opened:
                holder = [entry[0]]
                entry[0] = None
                t0 = time.perf_counter()
                ad.c_close(holder)
                t1 = time.perf_counter()
                closes.append(us(t0, t1))
        except Exception as e:
            res["close_error"] = f"after {len(closes)} closes: {errstr(e)}"
        res["close"] = summary(closes)
        opened.clear()
    try:
        ad.c_end_size()
    except Exception as e:
        res["consumer_cleanup_error"] = errstr(e)
    return res


def consumer_main(conn, system, cfg):
    for k, v in CHILD_ENV.items():
        os.environ.setdefault(k, v)
    try:
        ad = make_adapter(system, cfg)
        ad.c_setup()
        cp = _cupy(required=False)
        if cp is not None:
            cp.cuda.Device(cfg["device"]).use()
        conn.send(("ready", {"pid": os.getpid(), **ad.info}))
    except Exception as e:
        conn.send(("fatal", errstr(e), traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            conn.send(("bye",))
            return
        _, size, job = msg
        try:
            res = _consumer_job(ad, cp, size, job, cfg)
        except Exception as e:
            res = {"error": "consumer: " + errstr(e), "traceback": traceback.format_exc()}
        conn.send(("result", res))


# ---- producer ----------------------------------------------------------------

class ConsumerGone(Exception):
    pass


class ConsumerSetupFailed(Exception):
    pass


def _wait(conn, proc, timeout):
    deadline = time.monotonic() + timeout
    while True:
        try:
            if conn.poll(0.5):
                return conn.recv()
        except (EOFError, OSError):
            proc.join(2)
            raise ConsumerGone(f"consumer died (exit code {proc.exitcode})")
        if not proc.is_alive():
            try:
                if conn.poll(0):
                    return conn.recv()
            except (EOFError, OSError):
                pass
            raise ConsumerGone(f"consumer died (exit code {proc.exitcode})")
        if time.monotonic() > deadline:
            proc.terminate()
            proc.join(5)
            raise ConsumerGone(f"consumer timed out after {timeout:.0f} s")


def _start_consumer(system, cfg):
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=consumer_main, args=(child, system, cfg), daemon=True)
    proc.start()
    child.close()
    msg = _wait(parent, proc, cfg["msg_timeout"])
    if msg[0] != "ready":
        proc.join(5)
        raise ConsumerSetupFailed(f"consumer setup failed: {msg[1]}")
    return parent, proc, msg[1]


def _stop_consumer(conn, proc):
    try:
        conn.send(("stop",))
        _wait(conn, proc, 30)
    except Exception:
        pass
    proc.join(10)
    if proc.is_alive():
        proc.terminate()
        proc.join(5)


def producer_main(system, cfg, out_path):
    for k, v in CHILD_ENV.items():
        os.environ.setdefault(k, v)
    result = {"system": system, "label": _label(system), "status": "ok",
              "sizes": {}, "notes": [], "info": {}}

    def write():
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1, default=str)

    ad = make_adapter(system, cfg)
    try:
        ad.p_setup()
        result["info"].update(ad.info)
    except Exception as e:
        result["status"] = "n/a: " + errstr(e)
        result["traceback"] = traceback.format_exc()
        write()
        return
    result["reopen_note"] = ad.reopen_note
    conn = proc = None
    setup_failure = None
    for size in cfg["sizes"]:
        k = k_for(size, cfg, system)
        r = {"k": k}
        bufs = []
        t_size = time.perf_counter()
        try:
            if setup_failure:
                raise ConsumerSetupFailed(setup_failure)
            timings, extra = ad.p_begin_size(size, k)
            r.update(timings)
            for _ in range(k):
                bufs.append(ad.p_alloc(size))
            ad.p_sync()
            filled = False
            try:
                ad.p_fill(bufs[0], size, PATTERN)
                ad.p_sync()
                filled = True
            except Exception as e:
                r["fill_error"] = errstr(e)
            exports, payloads = [], []
            for b in bufs:
                t0 = time.perf_counter()
                p = ad.p_export(b)
                t1 = time.perf_counter()
                exports.append(us(t0, t1))
                payloads.append(p)
            r["export_first"] = summary(exports)
            repeat_payloads = []
            if ad.repeat_supported:
                n = cfg["torch_repeat"] if ad.keep_repeat_payloads else cfg["repeat_export"]
                exp = getattr(ad, "p_export_repeat", ad.p_export)
                rep = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    p = exp(bufs[0])
                    t1 = time.perf_counter()
                    rep.append(us(t0, t1))
                    if ad.keep_repeat_payloads:
                        repeat_payloads.append(p)
                r["export_repeat"] = summary(rep)
            try:
                r["payload_pickled_bytes"] = len(pickle.dumps(payloads[0]))
            except Exception as e:
                r["payload_pickled_bytes"] = f"not picklable with plain pickle: {errstr(e)}"
            keys = [ad.p_distinct_key(p) for p in payloads]
            if keys and keys[0] is not None:
                r["distinct_allocations"] = len(set(keys))
            if conn is None:
                conn, proc, cinfo = _start_consumer(system, cfg)
                result["info"]["consumer"] = cinfo
            conn.send(("job", size, {"payloads": payloads, "extra": extra, "filled": filled,
                                     "reopen_payloads": repeat_payloads or None}))
            msg = _wait(conn, proc, cfg["msg_timeout"])
            if msg[0] == "result":
                r.update(msg[1])
            else:
                r["error"] = f"unexpected consumer message {msg[0]!r}"
        except SizeSkipped as e:
            r["skipped"] = str(e)
        except ConsumerSetupFailed as e:
            r["error"] = str(e)
            setup_failure = str(e)        # the same failure would repeat: do not respawn
        except ConsumerGone as e:
            r["error"] = str(e)
            conn = proc = None            # a fresh consumer for the next size
        except Exception as e:
            r["error"] = errstr(e)
            r["traceback"] = traceback.format_exc()
        finally:
            try:
                ad.p_free(bufs)
            except Exception as e:
                r["free_error"] = errstr(e)
        r["wall_s"] = time.perf_counter() - t_size
        result["sizes"][str(size)] = r
        log(f"{_label(system)}: {fmt_size(size)} done in {r['wall_s']:.1f} s"
            + (f" ({r.get('error') or r.get('skipped')})" if r.get("error") or r.get("skipped") else ""))
        write()
    if conn is not None:
        _stop_consumer(conn, proc)
    write()


# ---- machine info (its own process) ------------------------------------------

def info_main(cfg, out_path):
    info = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "hostname": platform.node(), "python": sys.version.split()[0],
            "platform": platform.platform()}
    idx = cfg["device"]
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["gpu_name"] = torch.cuda.get_device_name(idx)
    except Exception as e:
        info["torch_error"] = errstr(e)
    try:
        import cupy as cp
        info["cupy"] = cp.__version__
        dv = cp.cuda.runtime.driverGetVersion()
        rv = cp.cuda.runtime.runtimeGetVersion()
        info["cuda_driver_api_version"] = f"{dv // 1000}.{dv % 1000 // 10}"
        info["cuda_runtime_version"] = f"{rv // 1000}.{rv % 1000 // 10}"
        props = cp.cuda.runtime.getDeviceProperties(idx)
        name = props.get("name", b"")
        info.setdefault("gpu_name", name.decode() if isinstance(name, bytes) else str(name))
        info["gpu_total_mem_GiB"] = round(props.get("totalGlobalMem", 0) / GiB, 1)
    except Exception as e:
        info["cupy_error"] = errstr(e)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,memory.total",
                              "--format=csv,noheader", "-i", str(idx)],
                             capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = out.stdout.strip() or out.stderr.strip()
        if out.returncode == 0 and out.stdout.strip():
            info["driver_version"] = out.stdout.split(",")[0].strip()
    except Exception as e:
        info["nvidia_smi_error"] = errstr(e)
    for mod, dist in (("cuda.core", "cuda-core"), ("numpy", "numpy"), ("matplotlib", "matplotlib"),
                      ("cuda.bindings", "cuda-bindings")):
        try:
            from importlib.metadata import version
            info[mod] = version(dist)
        except Exception:
            info[mod] = "not installed"
    try:
        usmipc = _import_usmipc()
        info["usmipc"] = usmipc.__version__
        info["usmipc_backends"] = str(usmipc.backends())
        from usmipc.memory import is_ipc_available
        info["usmipc_ipc_available"] = is_ipc_available(f"cuda:gpu:{idx}")
    except Exception as e:
        info["usmipc_error"] = errstr(e)
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            info["yama_ptrace_scope"] = f.read().strip()
    except Exception:
        info["yama_ptrace_scope"] = "absent"
    try:
        st = os.statvfs("/dev/shm")
        info["dev_shm_free_MiB"] = st.f_bavail * st.f_frsize // MiB
    except Exception:
        pass
    info["env"] = {k: os.environ[k] for k in sorted(os.environ)
                   if k.startswith(("USMIPC_", "PYTORCH_", "CUDA_", "NCCL_", "TORCH_"))}
    with open(out_path, "w") as f:
        json.dump(info, f, indent=1, default=str)


# ---- driver -------------------------------------------------------------------

def _run_child(args, env, timeout, tag):
    """Run this script in a child role; stream its stderr; kill its group on timeout."""
    fd, out_path = tempfile.mkstemp(prefix="bench_cuda_", suffix=".json")
    os.close(fd)
    os.unlink(out_path)
    cmd = [sys.executable, os.path.abspath(__file__)] + args + ["--_out", out_path]
    tail = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, errors="replace", start_new_session=True)

    def pump():
        for line in proc.stderr:
            sys.stderr.write(f"  [{tag}] {line}")
            tail.append(line.rstrip())
            del tail[:-40]

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)    # the producer and its consumer
        except ProcessLookupError:
            pass
        proc.wait()
    th.join(5)
    data = None
    if os.path.exists(out_path):
        try:
            with open(out_path) as f:
                data = json.load(f)
        except Exception:
            data = None
        os.unlink(out_path)
    return data, proc.returncode, timed_out, tail


def run_all(args, cfg):
    base_env = dict(os.environ, **CHILD_ENV)
    if args.fd_transport:
        base_env["USMIPC_FD_TRANSPORT"] = args.fd_transport
    cfg_json = json.dumps(cfg)
    t_start = time.perf_counter()
    log("machine info ...")
    meta, rc, to, tail = _run_child(["--_role", "info", "--_cfg", cfg_json], base_env, 120, "info")
    if meta is None:
        meta = {"error": f"info process failed (rc={rc}, timed_out={to}): " + " | ".join(tail[-5:])}
    results = {}
    for system in cfg["systems"]:
        env = dict(base_env)
        if system.startswith("usmipc-"):
            env["USMIPC_CUDA_IPC"] = system.split("-", 1)[1]
        log(f"{_label(system)} ...")
        t0 = time.perf_counter()
        data, rc, to, tail = _run_child(
            ["--_role", "producer", "--_system", system, "--_cfg", cfg_json],
            env, cfg["system_timeout"], system)
        wall = time.perf_counter() - t0
        if data is None:
            why = "timed out" if to else f"producer exited with code {rc}"
            data = {"system": system, "label": _label(system), "sizes": {}, "notes": [],
                    "status": f"n/a: {why}: " + " | ".join(tail[-3:])}
        elif to:
            data["timed_out"] = True
            data.setdefault("notes", []).append(
                f"timed out after {cfg['system_timeout']} s; sizes missing from the table did not finish")
        elif rc not in (0, None):
            data.setdefault("notes", []).append(f"producer exited with code {rc}: " + " | ".join(tail[-3:]))
        data["wall_s"] = wall
        results[system] = data
        log(f"{_label(system)}: {data.get('status')} in {wall:.1f} s")
    meta["total_wall_s"] = time.perf_counter() - t_start
    return {"meta": meta, "config": cfg, "results": results}


# ---- report -------------------------------------------------------------------

def _fmt_us(v):
    if v is None:
        return "—"
    if v < 10:
        return f"{v:.2f}"
    if v < 1000:
        return f"{v:.1f}"
    return f"{v:,.0f}"


def _short(text, n=48):
    t = " ".join(str(text).split()).replace("|", "/")
    return t if len(t) <= n else t[: n - 1] + "…"


def _cell_med(key):
    def f(r):
        s = r.get(key)
        return _fmt_us(s["median"]) if isinstance(s, dict) else None
    return f


def _cell_scalar(key, fmt):
    def f(r):
        v = r.get(key)
        return fmt(v) if isinstance(v, (int, float)) else None
    return f


def _cell_first_open(r):
    s = r.get("open_first")
    if not isinstance(s, dict):
        return None
    text = _fmt_us(s["median"])
    if r.get("open_error"):
        text += f" (only {r.get('opened')} opened)"
    return text


def _cell_reopen(r):
    s = r.get("reopen_open")
    err = r.get("reopen_error")
    if isinstance(s, dict):
        n = r.get("reopen_n") or s["n"]
        same = r.get("reopen_same_ptr", 0)
        tag = "same ptr" if same == n else ("new ptr" if same == 0 else f"same ptr {same}/{n}")
        text = f"{_fmt_us(s['median'])} ({tag})"
        if err:
            text += " then error: " + _short(err, 40)
        return text
    if err:
        return "error: " + _short(err, 60)
    return None


METRICS = [
    ("export_first", "Export latency: first export of each fresh buffer (median µs, producer)",
     _cell_med("export_first")),
    ("export_repeat", "Export latency: repeated export of the same buffer (median µs, producer)",
     _cell_med("export_repeat")),
    ("open_first", "First open in the consumer: handle -> usable device pointer (median µs over K fresh buffers)",
     _cell_first_open),
    ("reopen", "Cached re-open: open again while already open (median µs of the open call)",
     _cell_reopen),
    ("close", "Close / release of each first-opened mapping (median µs)", _cell_med("close")),
    ("bw_imported", "Consumer read bandwidth: imported buffer -> local buffer, D2D copy (GB/s, median)",
     _cell_scalar("bw_imported_GBps", lambda v: f"{v:,.1f}")),
    ("bw_local", "Same copy from a local buffer (GB/s, median)",
     _cell_scalar("bw_local_GBps", lambda v: f"{v:,.1f}")),
    ("bw_ratio", "Imported / local bandwidth", _cell_scalar("bw_ratio", lambda v: f"{v:.3f}x")),
]


def _cell(sysres, size, fn, metric):
    status = sysres.get("status", "ok")
    if status != "ok":
        return _short(status)
    r = sysres.get("sizes", {}).get(str(size))
    if r is None:
        return "n/a: timed out" if sysres.get("timed_out") else "n/a: not run"
    if r.get("skipped"):
        return "n/a: " + _short(r["skipped"], 40)
    v = fn(r)
    if v is not None:
        return v
    if r.get("error"):
        return "n/a: " + _short(r["error"])
    if metric == "reopen" and sysres.get("system") == "staged":
        return "n/a (copy)"
    if metric.startswith("bw") and r.get("bw_error"):
        return "n/a: " + _short(r["bw_error"])
    if metric.startswith("bw") and sysres.get("system") == "staged":
        return "n/a (copy)"
    if metric == "export_repeat" and sysres.get("system") == "staged":
        return "n/a"
    return "—"


def _md_table(rows, header):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        out.append("| " + " | ".join(row) + " |")
    return "\n".join(out)


def format_report(doc):
    meta, cfg, results = doc["meta"], doc["config"], doc["results"]
    sizes = cfg["sizes"]
    lines = ["# CUDA IPC: usmipc side by side with CuPy, PyTorch, cuda.core", ""]
    gpu = meta.get("gpu_name", "?")
    drv = meta.get("driver_version") or "?"
    lines.append(f"- GPU: **{gpu}** (device {cfg['device']}); driver {drv}, CUDA driver API "
                 f"{meta.get('cuda_driver_api_version', '?')} (cupy.cuda.runtime.driverGetVersion), "
                 f"runtime {meta.get('cuda_runtime_version', '?')}")
    lines.append(f"- date (UTC): {meta.get('date_utc', '?')}; host {meta.get('hostname', '?')}; "
                 f"Python {meta.get('python', '?')}")
    lines.append(f"- versions: usmipc {meta.get('usmipc', '?')}, torch {meta.get('torch', '?')}, "
                 f"cupy {meta.get('cupy', '?')}, cuda.core {meta.get('cuda.core', '?')}, "
                 f"numpy {meta.get('numpy', '?')}")
    ks = ", ".join(f"{fmt_size(s)}: K={k_for(s, cfg, 'x')}" for s in sizes)
    lines.append(f"- K fresh buffers per size ({ks}); host-staged K <= {cfg['staged_k']}, "
                 f"sizes <= {fmt_size(cfg['staged_max'])}")
    reduced = [fmt_size(s) for s in sizes if k_for(s, cfg, "x") < cfg["k"]]
    if reduced:
        lines.append(f"- **K reduced to {cfg['k_large']} for {', '.join(reduced)}** "
                     f"(sizes >= {fmt_size(cfg['large_threshold'])}) to bound GPU memory and time")
    lines.append(f"- repeated export: {cfg['repeat_export']} calls (torch: {cfg['torch_repeat']}); "
                 f"cached re-open: {cfg['reopen']} open+close pairs (torch: {cfg['torch_repeat']} rebuilds); "
                 f"bandwidth: median of {cfg['bw_reps']} event-timed samples")
    if "error" in meta:
        lines.append(f"- machine info: {meta['error']}")
    if meta.get("usmipc_error"):
        lines.append(f"- usmipc import in the info process failed: {meta['usmipc_error']}")
    if "total_wall_s" in meta:
        lines.append(f"- total wall time {meta['total_wall_s']:.0f} s")
    lines.append("")
    header = ["system"] + [fmt_size(s) for s in sizes]
    order = [s for s in SYSTEMS if s in results] + [s for s in results if s not in SYSTEMS]
    for metric, title, fn in METRICS:
        rows = []
        for sk in order:
            sr = results[sk]
            rows.append([sr.get("label", SYSTEMS.get(sk, sk))] +
                        [_cell(sr, s, fn, metric) for s in sizes])
        lines += [f"## {title}", "", _md_table(rows, header), ""]
    # one-time costs (cuda.core pool export/import)
    one = []
    cc = results.get("cuda.core")
    if cc and cc.get("status") == "ok":
        for key, label in (("pool_export_us", "cuda.core pool export (producer, once per pool)"),
                           ("pool_import_us", "cuda.core pool import (consumer, once per pool)")):
            one.append([label] + [
                _fmt_us(cc["sizes"].get(str(s), {}).get(key))
                if isinstance(cc["sizes"].get(str(s), {}).get(key), (int, float)) else "—"
                for s in sizes])
    if one:
        lines += ["## One-time costs per pool (µs; cuda.core makes one pool per size here)", "",
                  _md_table(one, header), ""]
    # notes
    notes = []
    for sk in order:
        sr = results[sk]
        label = sr.get("label", sk)
        if sr.get("status", "ok") != "ok":
            notes.append(f"- **{label}**: {sr['status']}")
            continue
        info = sr.get("info", {})
        if info.get("kind_selected_by"):
            notes.append(f"- {label}: allocation kind selected by {info['kind_selected_by']}")
        if sr.get("reopen_note"):
            notes.append(f"- {label}, cached re-open = {sr['reopen_note']}")
        for s in sizes:
            r = sr.get("sizes", {}).get(str(s))
            if not r:
                continue
            tag = f"- {label} @ {fmt_size(s)}:"
            if "distinct_allocations" in r and r["distinct_allocations"] != r.get("k"):
                notes.append(f"{tag} only {r['distinct_allocations']} distinct allocations among "
                             f"K={r.get('k')} buffers: some 'first' opens were cache hits")
            if r.get("verified") is False:
                notes.append(f"{tag} **imported buffer did not hold the producer's pattern**")
            if r.get("readable_after_reopen") is False:
                notes.append(f"{tag} **first mapping no longer readable after the re-open loop** "
                             f"{r.get('readable_after_reopen_error', '')}")
            for key in ("error", "open_error", "reopen_error", "bw_error", "close_error",
                        "verify_error", "fill_error", "free_error", "consumer_cleanup_error"):
                if r.get(key):
                    notes.append(f"{tag} {key}: {r[key]}")
        for n in sr.get("notes", []):
            notes.append(f"- {label}: {n}")
    if notes:
        lines += ["## Notes", ""] + notes + [""]
    lines += ["Export = time to produce the shareable object in the producer (bytes for usmipc and "
              "CuPy, the (rebuild_fn, args) tuple for torch, the IPCBufferDescriptor for cuda.core, "
              "D2H into a new shm segment for host-staged); pickling it is not included. First open "
              "includes everything up to a usable device pointer (torch: rebuild_cuda_tensor incl. "
              "IPC event wait; host-staged: shm attach + cudaMalloc + H2D + sync).", ""]
    return "\n".join(lines)


def make_plot(doc, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cfg, results = doc["config"], doc["results"]
    sizes = cfg["sizes"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, key, title in ((axes[0], "export_first", "export latency (first export, median)"),
                           (axes[1], "open_first", "first-open latency in the consumer (median)")):
        for sk, sr in results.items():
            if sr.get("status", "ok") != "ok":
                continue
            xs, ys = [], []
            for s in sizes:
                st = sr.get("sizes", {}).get(str(s), {}).get(key)
                if isinstance(st, dict) and st.get("median", 0) > 0:
                    xs.append(s)
                    ys.append(st["median"])
            if xs:
                ax.plot(xs, ys, marker="o", label=sr.get("label", sk))
        if key == "open_first":
            cc = results.get("cuda.core", {})
            xs, ys = [], []
            for s in sizes:
                v = cc.get("sizes", {}).get(str(s), {}).get("pool_import_us")
                if isinstance(v, (int, float)) and v > 0:
                    xs.append(s)
                    ys.append(v)
            if xs:
                ax.plot(xs, ys, marker="x", linestyle="--", color="gray",
                        label="cuda.core pool import (once)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes)
        ax.set_xticklabels([fmt_size(s) for s in sizes])
        ax.set_xlabel("buffer size")
        ax.set_ylabel("µs")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    meta = doc.get("meta", {})
    fig.suptitle(f"CUDA IPC on {meta.get('gpu_name', '?')} (driver {meta.get('driver_version', '?')}), "
                 f"{meta.get('date_utc', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- self test (no GPU) ------------------------------------------------------

def _fake_summary(median):
    return {"median": median, "p10": median * 0.9, "p90": median * 1.2, "min": median * 0.8,
            "max": median * 2, "mean": median * 1.05, "first": median * 3, "n": 40}


def fake_doc():
    cfg = build_cfg(build_parser().parse_args([]))
    sizes = cfg["sizes"]
    base = {  # (export, open) medians per size, loosely after shared/ANCHORS.md
        "usmipc-fd": [(3.0, 60.0), (3.1, 62.0), (3.5, 110.0), (4.0, 300.0)],
        "usmipc-native": [(1.0, 30.0), (1.1, 38.0), (1.2, 63.0), (1.3, 120.0)],
        "cupy": [(2.2, 29.8), (3.9, 37.9), (5.0, 63.2), (5.5, 130.0)],
        "torch": [(14.4, 59.2), (12.3, 60.6), (14.2, 95.6), (15.0, 160.0)],
        "cuda.core": [(11.3, 1.8), (12.1, 3.1), (73.1, 287.6), (80.0, 1100.0)],
        "staged": [(60.0, 158.0), (250.0, 258.0), (15120.0, 29544.0), None],
    }
    results = {}
    for sk, vals in base.items():
        sr = {"system": sk, "label": _label(sk), "status": "ok", "sizes": {}, "notes": [],
              "info": {}, "reopen_note": make_adapter(sk, cfg).reopen_note}
        for s, v in zip(sizes, vals):
            k = k_for(s, cfg, sk)
            if v is None:
                sr["sizes"][str(s)] = {"k": k, "skipped": "skipped: above --staged-max 256 MiB"}
                continue
            r = {"k": k, "export_first": _fake_summary(v[0]), "open_first": _fake_summary(v[1]),
                 "close": _fake_summary(v[1] / 3), "verified": True}
            if sk != "staged":
                r["export_repeat"] = _fake_summary(v[0] / 2)
                r["reopen_open"] = _fake_summary(0.4 if sk.startswith("usmipc") else 20.0)
                r["reopen_n"] = 1000
                r["reopen_same_ptr"] = 1000
                r["bw_imported_GBps"] = 2000.0 * min(1.0, s / GiB) + 1.0
                r["bw_local_GBps"] = 2050.0 * min(1.0, s / GiB) + 1.0
                r["bw_ratio"] = r["bw_imported_GBps"] / r["bw_local_GBps"]
            if sk == "cuda.core":
                r["pool_export_us"] = 25.0
                r["pool_import_us"] = 90.0
                r["reopen_open"] = None
                r["reopen_n"] = 0
                r["reopen_error"] = "iteration 0: CUDAError: CUDA_ERROR_ALREADY_MAPPED"
            if sk == "torch":
                r["distinct_allocations"] = k if s > MiB else 1
            sr["sizes"][str(s)] = r
        results[sk] = sr
    results["cupy"]["sizes"][str(sizes[-1])] = {"k": 10, "error": "CUDARuntimeError: cudaErrorMemoryAllocation: out of memory"}
    results["usmipc-native"] = {"system": "usmipc-native", "label": SYSTEMS["usmipc-native"],
                                "status": "n/a: ImportError: No module named 'usmipc._usmipc'",
                                "sizes": {}, "notes": []}
    meta = {"gpu_name": "FAKE H200 (selftest)", "driver_version": "580.00",
            "cuda_driver_api_version": "13.0", "cuda_runtime_version": "13.0",
            "date_utc": "2026-01-01T00:00:00+00:00", "hostname": "selftest", "python": sys.version.split()[0],
            "usmipc": "0.1.0", "torch": "2.11", "cupy": "14.2", "cuda.core": "1.2", "numpy": "x",
            "total_wall_s": 123.0}
    return {"meta": meta, "config": cfg, "results": results}


def selftest(args):
    assert parse_size("4K") == 4096 and parse_size("4KiB") == 4096 and parse_size("1M") == MiB
    assert parse_size("256MiB") == 256 * MiB and parse_size("1G") == GiB and parse_size("4096") == 4096
    assert parse_sizes(DEFAULT_SIZES) == [4 * KiB, MiB, 256 * MiB, GiB]
    assert fmt_size(4096) == "4 KiB" and fmt_size(GiB) == "1 GiB" and fmt_size(1000) == "1000 B"
    assert parse_systems("usmipc,cupy") == ["usmipc-fd", "usmipc-native", "cupy"]
    try:
        parse_systems("nope")
        raise AssertionError("unknown system accepted")
    except ValueError:
        pass
    s = summary([5.0, 1.0, 3.0])
    assert s["median"] == 3.0 and s["first"] == 5.0 and s["min"] == 1.0 and s["n"] == 3
    cfg = build_cfg(build_parser().parse_args(["--sizes", "4K,1G", "--k", "40", "--k-large", "10"]))
    assert k_for(4096, cfg, "cupy") == 40 and k_for(GiB, cfg, "cupy") == 10
    assert k_for(4096, cfg, "staged") == cfg["staged_k"]
    doc = fake_doc()
    text = format_report(doc)
    print(text)
    for needle in ("| system | 4 KiB | 1 MiB | 256 MiB | 1 GiB |", "n/a: ImportError", "n/a: CUDARuntimeError",
                   "K reduced to 10", "cuda.core pool import", "error: iteration 0", "(same ptr)",
                   "only 1 distinct allocations"):
        assert needle in text, f"selftest: {needle!r} missing from the report"
    json.dumps(doc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(doc, report_markdown=text), f, indent=1)
    if args.plot:
        try:
            make_plot(doc, args.plot)
            print(f"selftest: plot written to {args.plot}")
        except ImportError as e:
            print(f"selftest: plot skipped ({errstr(e)})")
    # the real machinery (info child, producer subprocess, spawned consumer,
    # pipe protocol) on host shared memory
    pipe_args = build_parser().parse_args(["--systems", "mock", "--sizes", "4K,64K", "--k", "5"])
    pipe_cfg = build_cfg(pipe_args)
    pipe_cfg.update(repeat_export=50, reopen=50, system_timeout=120.0, msg_timeout=60.0)
    pdoc = run_all(pipe_args, pipe_cfg)
    mock = pdoc["results"]["mock"]
    assert mock["status"] == "ok", mock
    for size in pipe_cfg["sizes"]:
        r = mock["sizes"][str(size)]
        assert not r.get("error"), r
        assert r["open_first"]["n"] == 5 and r["export_first"]["n"] == 5, r
        assert r["reopen_n"] == 50 and r["close"]["n"] == 5 and r["distinct_allocations"] == 5, r
    ptext = format_report(pdoc)
    assert "mock (host shm; selftest only)" in ptext
    print(ptext)
    print("selftest: 2 passed, 0 failed")
    return 0


# ---- CLI ----------------------------------------------------------------------

def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="systems: " + ", ".join(f"{k} ({v})" for k, v in SYSTEMS.items())
                                 + "; aliases: usmipc, all")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma list, suffixes K/M/G (default %(default)s)")
    ap.add_argument("--systems", default="all", help="comma list of systems (default: all)")
    ap.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    ap.add_argument("--k", type=int, default=40, help="fresh buffers per size (default 40)")
    ap.add_argument("--k-large", type=int, default=10,
                    help="fresh buffers for sizes >= --large-threshold (default 10)")
    ap.add_argument("--large-threshold", default="512M", help="(default 512M)")
    ap.add_argument("--repeat-export", type=int, default=1000,
                    help="repeated exports of one buffer (default 1000)")
    ap.add_argument("--reopen", type=int, default=1000,
                    help="cached re-open open+close pairs (default 1000)")
    ap.add_argument("--torch-repeat", type=int, default=200,
                    help="torch repeated exports = cached rebuilds (each makes a ref-counter slot; default 200)")
    ap.add_argument("--bw-reps", type=int, default=20, help="bandwidth samples (default 20)")
    ap.add_argument("--staged-k", type=int, default=10, help="K for the host-staged baseline (default 10)")
    ap.add_argument("--staged-max", default="256M", help="largest host-staged size (default 256M)")
    ap.add_argument("--usmipc-filter", default=None,
                    help="usmipc device filter (default cuda:gpu:<--device>; host:cpu tests the plumbing)")
    ap.add_argument("--fd-transport", default=None, choices=["auto", "socket", "pidfd"],
                    help="set USMIPC_FD_TRANSPORT for usmipc (default: leave as is)")
    ap.add_argument("--system-timeout", type=float, default=180.0,
                    help="seconds per system before it is killed (default 180)")
    ap.add_argument("--msg-timeout", type=float, default=120.0,
                    help="seconds to wait for the consumer per size (default 120)")
    ap.add_argument("--json", default=None, help="write everything to this JSON file")
    ap.add_argument("--plot", default=None, help="write a PNG of export/first-open latency vs size")
    ap.add_argument("--selftest", action="store_true", help="format a fake results dict (no GPU) and exit")
    ap.add_argument("--_role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_system", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_cfg", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    return ap


def build_cfg(args):
    return {
        "sizes": parse_sizes(args.sizes),
        "systems": parse_systems(args.systems),
        "device": args.device,
        "k": args.k,
        "k_large": args.k_large,
        "large_threshold": parse_size(args.large_threshold),
        "repeat_export": args.repeat_export,
        "reopen": args.reopen,
        "torch_repeat": args.torch_repeat,
        "bw_reps": args.bw_reps,
        "staged_k": args.staged_k,
        "staged_max": parse_size(args.staged_max),
        "system_timeout": args.system_timeout,
        "msg_timeout": args.msg_timeout,
        "fd_transport": args.fd_transport,
        "usmipc_filter": args.usmipc_filter,
    }


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args._role == "producer":
        producer_main(args._system, json.loads(args._cfg), args._out)
        return 0
    if args._role == "info":
        info_main(json.loads(args._cfg), args._out)
        return 0
    if args.selftest:
        return selftest(args)
    try:
        cfg = build_cfg(args)
    except ValueError as e:
        ap.error(str(e))
    doc = run_all(args, cfg)
    text = format_report(doc)
    print(text)
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(dict(doc, report_markdown=text), f, indent=1, default=str)
            log(f"JSON written to {args.json}")
        except Exception as e:
            log(f"JSON not written: {errstr(e)}")
    if args.plot:
        try:
            make_plot(doc, args.plot)
            log(f"plot written to {args.plot}")
        except Exception as e:
            log(f"plot not written: {errstr(e)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
