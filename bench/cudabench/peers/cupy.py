"""CuPy: raw cudaIpcGetMemHandle / cudaIpcOpenMemHandle /
cudaIpcCloseMemHandle (cupy.cuda.runtime) on a fresh cudaMalloc per buffer."""
from ..harness import Adapter, import_cupy


class CupyAdapter(Adapter):
    reopen_note = ("cudaIpcOpenMemHandle + cudaIpcCloseMemHandle on a handle that is "
                   "already open in this process")

    def _common(self):
        cp = import_cupy()
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
