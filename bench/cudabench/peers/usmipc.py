"""usmipc: MemoryUSMDevice with ipc='fd' (cuMemCreate, POSIX fd) or
ipc='native' (cuMemAlloc + cuIpcGetMemHandle); IPCMemoryHandle(...).to_bytes()
exports, IPCMemoryHandle.open(...) opens, close_mapping closes."""
import gc
import os

from ..harness import Adapter, errstr, import_usmipc


class UsmipcAdapter(Adapter):
    def __init__(self, cfg, kind):
        super().__init__(cfg)
        self.kind = kind
        self.reopen_note = "open+close of the same handle while it is open (import cache)"

    def _common(self):
        usmipc = import_usmipc()
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
