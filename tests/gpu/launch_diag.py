"""Where a consumer's kernel launch blocks (issue 21 #2 on the H200: queueing
a 3 s torch.cuda._sleep plus a fill on a mapping took 3 s of host time).
Times each launch in child processes: plain torch, torch after importing
usmipc, and on a usmipc mapping (fd and native), with and without the
stream= of the open.   python3 tests/gpu/launch_diag.py"""
import os
import subprocess
import sys
import time

CYC = 1976 * 1000  # cycles per ms on the H200 (tickets_exit.py calibrates)


def timed(label, f):
    t0 = time.perf_counter()
    f()
    print(f"  {label}: {time.perf_counter() - t0:.3f} s", flush=True)


def child(role):
    import torch
    if role != "plain":
        import usmipc  # noqa: F401
        from usmipc.memory import IPCMemoryHandle
    s = torch.cuda.Stream()
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    if role in ("plain", "import"):
        y = torch.zeros(1 << 20, dtype=torch.int32, device="cuda:0")
    else:
        raw = bytes.fromhex(sys.stdin.readline().strip())
        kw = {"stream": s} if role == "mapped-stream" else {}
        m = IPCMemoryHandle.open(raw, None, **kw)
        with torch.cuda.stream(s):
            y = torch.from_dlpack(m).view(torch.int32)
    print(f"{role}, USMIPC_CUDA_IPC={os.environ.get('USMIPC_CUDA_IPC')}, "
          f"CUDA_LAUNCH_BLOCKING={os.environ.get('CUDA_LAUNCH_BLOCKING')}",
          flush=True)
    with torch.cuda.stream(s):
        timed("_sleep(1 s) launch", lambda: torch.cuda._sleep(1000 * CYC))
        timed("fill_ launch", lambda: y.fill_(7))
        timed("_sleep(1 s) again", lambda: torch.cuda._sleep(1000 * CYC))
        timed("add_ launch", lambda: y.add_(1))
    timed("synchronize", s.synchronize)
    if role.startswith("mapped"):
        IPCMemoryHandle.close_mapping(m)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return child(sys.argv[2])
    import torch
    from usmipc.memory import IPCMemoryHandle
    x = torch.zeros(1 << 20, dtype=torch.int32, device="cuda:0")
    for role in ("plain", "import", "mapped", "mapped-stream"):
        for rel in ((False, True) if role.startswith("mapped") else (False,)):
            p = subprocess.Popen([sys.executable, __file__, "--child", role],
                                 stdin=subprocess.PIPE, text=True)
            if role.startswith("mapped"):
                h = IPCMemoryHandle(x, release=rel)
                print(f"(producer handle release={rel})", flush=True)
                p.stdin.write(h.to_bytes().hex() + "\n")
                p.stdin.flush()
            p.wait(timeout=60)


main()
