"""PyTorch: torch.multiprocessing's reduce_tensor on the producer side (the
(rebuild_cuda_tensor, args) tuple it pickles), rebuild_cuda_tensor(*args) on
the consumer side; each tensor alone in its caching-allocator segment."""
import gc
import os

from ..harness import Adapter, MiB


class TorchAdapter(Adapter):
    keep_repeat_payloads = True
    reopen_note = ("rebuild_cuda_tensor(*args) again while the first tensor is alive: "
                   "hits torch.multiprocessing's shared_cache (keyed by handle+offset) "
                   "and releases that send's ref counter")

    @classmethod
    def repeat_count(cls, cfg):
        return cfg["torch_repeat"]   # each repeat makes a ref-counter slot

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
