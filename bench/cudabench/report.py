"""The report: Markdown tables (rows: systems, columns: sizes) of medians,
notes, and a plot of export and first-open latency against size.
"""
from .harness import fmt_size
from .measure import k_for
from .peers import SYSTEMS, adapter_class


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
    if metric.startswith("bw") and r.get("bw_error"):
        return "n/a: " + _short(r["bw_error"])
    cls = adapter_class(sysres.get("system"))
    na = cls.report_na.get("bw" if metric.startswith("bw") else metric) if cls else None
    return na or "—"


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
    # one-time costs (cuda.core pool export/import): a table per system that has them
    for sk in order:
        sr, cls = results[sk], adapter_class(sk)
        if cls is None or not cls.one_time_costs or sr.get("status") != "ok":
            continue
        title, costs = cls.one_time_costs
        one = []
        for key, label in costs:
            one.append([label] + [
                _fmt_us(sr["sizes"].get(str(s), {}).get(key))
                if isinstance(sr["sizes"].get(str(s), {}).get(key), (int, float)) else "—"
                for s in sizes])
        lines += [f"## {title}", "", _md_table(one, header), ""]
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
        for sk, sr in results.items():   # one-time costs beside (cuda.core pool import)
            cls = adapter_class(sk)
            for axis, once_key, label in (cls.plot_once if cls else ()):
                if axis != key:
                    continue
                xs, ys = [], []
                for s in sizes:
                    v = sr.get("sizes", {}).get(str(s), {}).get(once_key)
                    if isinstance(v, (int, float)) and v > 0:
                        xs.append(s)
                        ys.append(v)
                if xs:
                    ax.plot(xs, ys, marker="x", linestyle="--", color="gray", label=label)
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
