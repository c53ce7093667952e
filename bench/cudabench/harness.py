"""What a system's module builds on: the Adapter it implements, and the
units, sizes, summaries and helpers every part of bench_cuda.py shares.

Nothing here imports CUDA: the driver process never initialises it.
"""
import gc
import os
import statistics
import sys
import time

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = "4K,1M,256M,1G"
PATTERN = 0x5A           # byte the producer writes into buffer 0; the consumer checks it
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


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


def log(msg):
    sys.stderr.write(f"[bench_cuda {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def import_usmipc():
    """Import usmipc; fall back to the source tree's python/ (an in-place build)."""
    try:
        import usmipc
    except ImportError:
        here = os.path.dirname(os.path.abspath(__file__))
        src = os.path.join(os.path.dirname(os.path.dirname(here)), "python")
        if src not in sys.path:
            sys.path.insert(0, src)
        import usmipc
    return usmipc


def import_cupy(required=True):
    try:
        import cupy
        return cupy
    except Exception:
        if required:
            raise
        return None


# ---- the interface of a system: producer and consumer side -------------------

class SizeSkipped(Exception):
    """This system does not run at this size (reported as n/a, not an error)."""


class Adapter:
    """One system, on both sides of the pipe (measure.py drives it).

    The producer process calls p_setup once, then per size p_begin_size,
    p_alloc (K times), p_sync, p_fill, p_export (timed, once per buffer),
    p_export_repeat or p_export (timed, repeat_count(cfg) times on buffer 0)
    and p_free. The consumer process calls c_setup once, then per size
    c_begin_size, c_open (timed, once per payload), c_close and c_end_size.
    The class attributes below say what the system supports and how the
    report shows it.
    """
    repeat_supported = True     # repeated export of the same buffer makes sense
    keep_repeat_payloads = False  # send the repeated exports along (torch: ref counters)
    reopen_supported = True     # "open again while open" makes sense
    reopen_note = ""
    bw_supported = True
    # what the report shows where a metric does not apply to the system:
    # {"reopen" | "bw" | "export_repeat": cell text}
    report_na = {}
    # one-time costs the producer or consumer records per size (keys of a
    # size's results), shown in a table of their own: (title, ((key, row label), ...))
    one_time_costs = None
    # extra lines on the plot: ((axis key, result key, legend label), ...)
    plot_once = ()

    def __init__(self, cfg):
        self.cfg = cfg
        self.dev_index = cfg["device"]
        self.info = {}
        self.notes = []

    @classmethod
    def limit_k(cls, k, cfg):
        """The number of fresh buffers per size, given the configured k."""
        return k

    @classmethod
    def repeat_count(cls, cfg):
        """How many times buffer 0 is exported again."""
        return cfg["repeat_export"]

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
        cp = import_cupy(required=False)
        if cp is not None:
            cp.cuda.runtime.deviceSynchronize()

    def p_fill(self, buf, size, value):
        cp = import_cupy()
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
