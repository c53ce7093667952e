"""The driver: machine info, then each system's producer in a child process
of its own (this script again, in a role), with a timeout; the driver itself
never initialises CUDA.
"""
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time

from .harness import CHILD_ENV, GiB, MiB, errstr, import_usmipc, log
from .peers import label, system_env

# The script the children run: bench_cuda.py, in the role its arguments name.
ENTRY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_cuda.py")


# ---- machine info (its own process) ------------------------------------------

def info_main(cfg, out_path):
    info = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "hostname": platform.node(), "python": sys.version.split()[0],
            "platform": platform.platform()}
    idx = cfg["device"]
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["gpu_name"] = torch.cuda.get_device_name(idx)
    except Exception as e:
        info["torch_error"] = errstr(e)
    try:
        import cupy as cp
        info["cupy"] = cp.__version__
        dv = cp.cuda.runtime.driverGetVersion()
        rv = cp.cuda.runtime.runtimeGetVersion()
        info["cuda_driver_api_version"] = f"{dv // 1000}.{dv % 1000 // 10}"
        info["cuda_runtime_version"] = f"{rv // 1000}.{rv % 1000 // 10}"
        props = cp.cuda.runtime.getDeviceProperties(idx)
        name = props.get("name", b"")
        info.setdefault("gpu_name", name.decode() if isinstance(name, bytes) else str(name))
        info["gpu_total_mem_GiB"] = round(props.get("totalGlobalMem", 0) / GiB, 1)
    except Exception as e:
        info["cupy_error"] = errstr(e)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,memory.total",
                              "--format=csv,noheader", "-i", str(idx)],
                             capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = out.stdout.strip() or out.stderr.strip()
        if out.returncode == 0 and out.stdout.strip():
            info["driver_version"] = out.stdout.split(",")[0].strip()
    except Exception as e:
        info["nvidia_smi_error"] = errstr(e)
    for mod, dist in (("cuda.core", "cuda-core"), ("numpy", "numpy"), ("matplotlib", "matplotlib"),
                      ("cuda.bindings", "cuda-bindings")):
        try:
            from importlib.metadata import version
            info[mod] = version(dist)
        except Exception:
            info[mod] = "not installed"
    try:
        usmipc = import_usmipc()
        info["usmipc"] = usmipc.__version__
        info["usmipc_backends"] = str(usmipc.backends())
        from usmipc.memory import is_ipc_available
        info["usmipc_ipc_available"] = is_ipc_available(f"cuda:gpu:{idx}")
    except Exception as e:
        info["usmipc_error"] = errstr(e)
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            info["yama_ptrace_scope"] = f.read().strip()
    except Exception:
        info["yama_ptrace_scope"] = "absent"
    try:
        st = os.statvfs("/dev/shm")
        info["dev_shm_free_MiB"] = st.f_bavail * st.f_frsize // MiB
    except Exception:
        pass
    info["env"] = {k: os.environ[k] for k in sorted(os.environ)
                   if k.startswith(("USMIPC_", "PYTORCH_", "CUDA_", "NCCL_", "TORCH_"))}
    with open(out_path, "w") as f:
        json.dump(info, f, indent=1, default=str)


# ---- driver -------------------------------------------------------------------

def _run_child(args, env, timeout, tag):
    """Run this script in a child role; stream its stderr; kill its group on timeout."""
    fd, out_path = tempfile.mkstemp(prefix="bench_cuda_", suffix=".json")
    os.close(fd)
    os.unlink(out_path)
    cmd = [sys.executable, ENTRY] + args + ["--_out", out_path]
    tail = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, errors="replace", start_new_session=True)

    def pump():
        for line in proc.stderr:
            sys.stderr.write(f"  [{tag}] {line}")
            tail.append(line.rstrip())
            del tail[:-40]

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)    # the producer and its consumer
        except ProcessLookupError:
            pass
        proc.wait()
    th.join(5)
    data = None
    if os.path.exists(out_path):
        try:
            with open(out_path) as f:
                data = json.load(f)
        except Exception:
            data = None
        os.unlink(out_path)
    return data, proc.returncode, timed_out, tail


def run_all(args, cfg):
    base_env = dict(os.environ, **CHILD_ENV)
    if args.fd_transport:
        base_env["USMIPC_FD_TRANSPORT"] = args.fd_transport
    cfg_json = json.dumps(cfg)
    t_start = time.perf_counter()
    log("machine info ...")
    meta, rc, to, tail = _run_child(["--_role", "info", "--_cfg", cfg_json], base_env, 120, "info")
    if meta is None:
        meta = {"error": f"info process failed (rc={rc}, timed_out={to}): " + " | ".join(tail[-5:])}
    results = {}
    for system in cfg["systems"]:
        env = dict(base_env, **system_env(system))
        log(f"{label(system)} ...")
        t0 = time.perf_counter()
        data, rc, to, tail = _run_child(
            ["--_role", "producer", "--_system", system, "--_cfg", cfg_json],
            env, cfg["system_timeout"], system)
        wall = time.perf_counter() - t0
        if data is None:
            why = "timed out" if to else f"producer exited with code {rc}"
            data = {"system": system, "label": label(system), "sizes": {}, "notes": [],
                    "status": f"n/a: {why}: " + " | ".join(tail[-3:])}
        elif to:
            data["timed_out"] = True
            data.setdefault("notes", []).append(
                f"timed out after {cfg['system_timeout']} s; sizes missing from the table did not finish")
        elif rc not in (0, None):
            data.setdefault("notes", []).append(f"producer exited with code {rc}: " + " | ".join(tail[-3:]))
        data["wall_s"] = wall
        results[system] = data
        log(f"{label(system)}: {data.get('status')} in {wall:.1f} s")
    meta["total_wall_s"] = time.perf_counter() - t_start
    return {"meta": meta, "config": cfg, "results": results}
