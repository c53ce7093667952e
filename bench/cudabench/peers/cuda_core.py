"""cuda.core: an IPC-enabled DeviceMemoryResource (a CUDA memory pool) per
size, exported once (its allocation handle, a POSIX fd) and imported once by
the consumer; each buffer travels as Buffer.ipc_descriptor and is opened
with Buffer.from_ipc_descriptor (cuMemPoolImportPointer)."""
import gc
import time

from ..harness import Adapter, MiB, us


class CudaCoreAdapter(Adapter):
    reopen_note = ("Buffer.from_ipc_descriptor(mmr, desc) + close() for a descriptor "
                   "whose buffer is already imported (cuMemPoolImportPointer again)")
    one_time_costs = ("One-time costs per pool (µs; cuda.core makes one pool per size here)", (
        ("pool_export_us", "cuda.core pool export (producer, once per pool)"),
        ("pool_import_us", "cuda.core pool import (consumer, once per pool)")))
    plot_once = (("open_first", "pool_import_us", "cuda.core pool import (once)"),)

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

    def _sync_and_close(self, attr):
        """Synchronizes, collects, then closes the memory resource in self.<attr>."""
        self.dev.sync()
        gc.collect()
        mr = getattr(self, attr)
        if mr is not None:
            try:
                mr.close()
            except Exception:
                pass
            setattr(self, attr, None)

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
        self._sync_and_close("mr")

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
        self._sync_and_close("mmr")
