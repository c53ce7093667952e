"""bench_cuda.py --selftest (no GPU needed): the helpers, the report of a
fake results document, then the real machinery (info child, producer
subprocess, spawned consumer, pipe protocol) on host shared memory.
"""
import json
import sys

from .harness import DEFAULT_SIZES, GiB, KiB, MiB, errstr, fmt_size, parse_size, parse_sizes, summary
from .measure import k_for
from .peers import SYSTEMS, label, make_adapter, parse_systems
from .report import format_report, make_plot
from .runner import run_all


# ---- self test (no GPU) ------------------------------------------------------

def _fake_summary(median):
    return {"median": median, "p10": median * 0.9, "p90": median * 1.2, "min": median * 0.8,
            "max": median * 2, "mean": median * 1.05, "first": median * 3, "n": 40}


def fake_doc(parse):
    _, cfg = parse([])
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
        sr = {"system": sk, "label": label(sk), "status": "ok", "sizes": {}, "notes": [],
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


def selftest(args, parse):
    """parse(argv) -> (args, cfg): bench_cuda.py's options."""
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
    _, cfg = parse(["--sizes", "4K,1G", "--k", "40", "--k-large", "10"])
    assert k_for(4096, cfg, "cupy") == 40 and k_for(GiB, cfg, "cupy") == 10
    assert k_for(4096, cfg, "staged") == cfg["staged_k"]
    doc = fake_doc(parse)
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
    pipe_args, pipe_cfg = parse(["--systems", "mock", "--sizes", "4K,64K", "--k", "5"])
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
