"""How every system is measured: its producer and consumer processes.

The producer (a process of its own, started by runner.py) allocates K fresh
buffers per size, exports them (timed), exports buffer 0 again (timed), and
keeps them alive until the consumer has reported. The consumer (started by
the producer with multiprocessing's spawn context: never fork after CUDA
init) opens every handle once (a true first open, timed), checks the
producer's pattern, reads the first imported buffer with device-to-device
copies (CUDA events), times re-opens of an already-open handle, and closes
everything (timed). The system's Adapter (peers/) does each step; this file
times them, the same way for every system.
"""
import json
import os
import pickle
import statistics
import time
import traceback

from .harness import (CHILD_ENV, MiB, PATTERN, SizeSkipped, errstr, fmt_size, import_cupy, log,
                      summary, us)
from .peers import adapter_class, label, make_adapter


def k_for(size, cfg, system):
    k = cfg["k_large"] if size >= cfg["large_threshold"] else cfg["k"]
    cls = adapter_class(system)
    if cls is not None:
        k = cls.limit_k(k, cfg)
    return max(1, k)


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
        cp = import_cupy(required=False)
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
    result = {"system": system, "label": label(system), "status": "ok",
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
                n = ad.repeat_count(cfg)
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
        log(f"{label(system)}: {fmt_size(size)} done in {r['wall_s']:.1f} s"
            + (f" ({r.get('error') or r.get('skipped')})" if r.get("error") or r.get("skipped") else ""))
        write()
    if conn is not None:
        _stop_consumer(conn, proc)
    write()
