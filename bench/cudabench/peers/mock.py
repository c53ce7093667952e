"""Host shared memory standing in for a GPU system, so that --selftest drives
the real producer/consumer machinery without CUDA (not in the default run)."""
from ..harness import Adapter


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
