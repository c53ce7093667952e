"""The baseline without IPC: the producer copies each buffer to the host
into POSIX shared memory (D2H), the consumer attaches it and copies it into
a fresh cudaMalloc (H2D)."""
import os

from ..harness import Adapter, MiB, SizeSkipped, fmt_size, import_cupy


class StagedAdapter(Adapter):
    """Baseline without IPC: D2H into POSIX shared memory, attach + H2D in the consumer."""
    repeat_supported = False
    reopen_supported = False
    bw_supported = False
    reopen_note = "n/a: every open is a fresh copy"
    report_na = {"reopen": "n/a (copy)", "bw": "n/a (copy)", "export_repeat": "n/a"}

    @classmethod
    def limit_k(cls, k, cfg):
        return min(k, cfg["staged_k"])

    def _common(self):
        cp = import_cupy()
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
