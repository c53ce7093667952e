"""``python -m usmipc``: what this machine offers, and a cross-process demo.

    python -m usmipc                       backends and devices
    python -m usmipc demo [--device F] [--nbytes N]
                                           share device memory with a child
                                           process and check both directions

The demo is the project's main job end to end: the parent allocates device
memory, fills it with a known pattern and exports an IPCMemoryHandle; a
separate child process (started with subprocess, not fork) receives the
handle bytes on its standard input, maps them, checks the pattern, writes a
second pattern, closes the mapping and reports its timings; the parent then
reads the second pattern back. The exit status is non-zero on any mismatch.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import uuid as _uuid

import usmipc
from usmipc.memory import IPCMemoryHandle, MemoryUSMDevice

# A period of 251 (prime) bytes, so that an offset error cannot go unseen.
_PERIOD = 251


def _pattern(nbytes, salt):
    block = bytes(((i * 7) + salt) & 0xFF for i in range(_PERIOD))
    reps = nbytes // _PERIOD + 1
    return (block * reps)[:nbytes]


def _first_mismatch(got, want):
    if got == want:
        return None
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return min(len(got), len(want))


def _fd_transport():
    return os.environ.get("USMIPC_FD_TRANSPORT", "auto") or "auto"


def _format_uuid(raw):
    return str(_uuid.UUID(bytes=bytes(raw)))


def cmd_info(_args):
    print(f"usmipc {usmipc.__version__}")
    print("backends:")
    for name, (available, reason) in usmipc.backends().items():
        status = "available" if available else f"unavailable: {reason}"
        print(f"  {name:<11} {status}")
    print("devices:")
    devices = usmipc.get_devices()
    if not devices:
        print("  (none)")
    for d in devices:
        ipc = "yes" if d.has_aspect_ipc_memory else "no"
        print(f"  {d.filter_string:<16} {d.device_type:<4} ipc={ipc:<3} "
              f"uuid={_format_uuid(d.uuid)}  {d.name}")
    try:
        default = usmipc.Device()
        print(f"default device: {default.filter_string}")
    except usmipc.Error as e:  # pragma: no cover - no device at all
        print(f"default device: none ({e})")
    return 0


def cmd_demo(args):
    try:
        device = usmipc.Device(args.device)
    except (ValueError, usmipc.Error) as e:
        print(f"demo: cannot select device {args.device!r}: {e}",
              file=sys.stderr)
        return 2
    if args.nbytes <= 0:
        print("demo: --nbytes must be positive", file=sys.stderr)
        return 2
    if not device.has_aspect_ipc_memory:
        print(f"demo: device {device.filter_string} ({device.name}) does not "
              "support IPC memory", file=sys.stderr)
        return 2

    nbytes = args.nbytes
    first = _pattern(nbytes, 1)
    second = _pattern(nbytes, 0x5A)
    print(f"usmipc demo: {nbytes} bytes on {device.filter_string} "
          f"({device.name}), fd transport: {_fd_transport()}")

    # One-time set-up of this process (the backend's context, the export
    # table, the broker that hands out descriptors) is timed apart from the
    # operations, and every operation is reported first and warm: the first
    # thing a user runs should not make an export look like a context
    # creation.
    t0 = time.perf_counter()
    queue = usmipc.Queue(device)
    mem = MemoryUSMDevice(nbytes, queue=queue)
    alloc_us = (time.perf_counter() - t0) * 1e6
    mem.copy_from_host(first)

    t0 = time.perf_counter()
    handle = IPCMemoryHandle(mem)
    raw = handle.to_bytes()
    export_us = (time.perf_counter() - t0) * 1e6

    # Warm exports: fresh allocations of the same size, each exported once
    # (an allocation exported before is a table lookup, not an export).
    extra_mems = [MemoryUSMDevice(nbytes, queue=queue)
                  for _ in range(args.warm)]
    extra_raw, warm_export = [], []
    for m in extra_mems:
        t0 = time.perf_counter()
        extra_raw.append(IPCMemoryHandle(m).to_bytes())
        warm_export.append((time.perf_counter() - t0) * 1e6)

    request = {"handle": raw.hex(), "device": device.filter_string,
               "nbytes": nbytes, "reopen": args.reopen,
               "warm": [r.hex() for r in extra_raw]}
    child = subprocess.Popen(
        [sys.executable, "-m", "usmipc", "_demo_child"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = child.communicate(json.dumps(request) + "\n",
                                   timeout=args.timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        print(f"demo: the child did not answer within {args.timeout} s",
              file=sys.stderr)
        return 1
    report = None
    for line in out.splitlines():
        if line.startswith("{"):
            report = json.loads(line)
    if child.returncode != 0 or report is None or not report.get("ok"):
        print(f"demo: the child failed (exit {child.returncode}): "
              f"{(report or {}).get('error', out.strip())}", file=sys.stderr)
        return 1

    back = mem.tobytes()
    bad = _first_mismatch(back, second)
    if bad is not None:
        print(f"demo: the parent read wrong data at offset {bad}: "
              f"{back[bad:bad + 8].hex()} instead of "
              f"{second[bad:bad + 8].hex()}", file=sys.stderr)
        return 1

    n = len(warm_export)
    print(f"  handle size:  {len(raw)} bytes")
    print(f"  opened size:  {report['opened_nbytes']} bytes on "
          f"{report['device_name']}")
    print("  one-time set-up, once per process (not part of any operation):")
    print(f"    parent:     {alloc_us:.1f} us (device context and first "
          f"allocation)")
    print(f"    child:      {report['setup_us']:.1f} us (device context)")
    print("  operations, first in the process and then warm (median of "
          f"{n}):")
    print(f"    export:     {export_us:.1f} us first (includes starting "
          f"this process's descriptor broker), "
          f"{_median(warm_export):.1f} us warm (parent)")
    print(f"    open:       {report['open_us']:.1f} us first (includes the "
          f"first contact with the exporter), "
          f"{_median(report['warm_open_us']):.1f} us warm (child)")
    if report.get("reopen_us") is not None:
        print(f"    re-open:    {report['reopen_us']:.2f} us per open+close "
              f"of a mapping still cached (child, {args.reopen} re-opens)")
    print(f"    close:      {report['close_us']:.1f} us (child)")
    print("  data:         child read pattern 1 and wrote pattern 2; "
          "parent read pattern 2")
    print("demo OK")
    return 0


def _median(values):
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def cmd_demo_child(_args):
    """The child half of the demo: one JSON request on stdin, one on stdout."""
    def answer(**fields):
        print(json.dumps(fields), flush=True)
        return 0 if fields.get("ok") else 1

    try:
        request = json.loads(sys.stdin.readline())
        raw = bytes.fromhex(request["handle"])
        nbytes = int(request["nbytes"])
        device = usmipc.Device(request["device"])
        reopen = int(request.get("reopen", 0))
        warm = [bytes.fromhex(h) for h in request.get("warm", [])]

        # The device's context is made once per process: timed apart, so
        # that the first open is the open itself.
        t0 = time.perf_counter()
        MemoryUSMDevice(1, device=device)
        setup_us = (time.perf_counter() - t0) * 1e6

        t0 = time.perf_counter()
        mem = IPCMemoryHandle.open(raw, device)
        open_us = (time.perf_counter() - t0) * 1e6

        warm_open_us = []
        for h in warm:
            t0 = time.perf_counter()
            m = IPCMemoryHandle.open(h, device)
            warm_open_us.append((time.perf_counter() - t0) * 1e6)
            IPCMemoryHandle.close_mapping(m)

        got = mem.tobytes()
        bad = _first_mismatch(got, _pattern(nbytes, 1))
        if bad is not None:
            return answer(ok=False, error=f"child read wrong data at offset "
                                          f"{bad}")
        mem.copy_from_host(_pattern(nbytes, 0x5A))
        opened = mem.nbytes

        reopen_us = None
        if reopen > 0:
            open_, close = IPCMemoryHandle.open, IPCMemoryHandle.close_mapping
            t0 = time.perf_counter()
            for _ in range(reopen):
                close(open_(raw, device))
            reopen_us = (time.perf_counter() - t0) * 1e6 / reopen

        t0 = time.perf_counter()
        IPCMemoryHandle.close_mapping(mem)
        close_us = (time.perf_counter() - t0) * 1e6
        return answer(ok=True, opened_nbytes=opened, device_name=device.name,
                      setup_us=setup_us, open_us=open_us,
                      warm_open_us=warm_open_us, reopen_us=reopen_us,
                      close_us=close_us)
    except Exception as e:  # report every failure to the parent
        return answer(ok=False, error=f"{type(e).__name__}: {e}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    # The demo's child half is internal: kept out of --help and of the
    # choices an unknown command's error lists.
    if argv[:1] == ["_demo_child"]:
        return cmd_demo_child(None)
    parser = argparse.ArgumentParser(
        prog="python -m usmipc",
        description="usmipc: zero-copy sharing of accelerator memory between "
                    "processes. Without a command: list backends and "
                    "devices.")
    parser.add_argument("--version", action="version",
                        version=f"usmipc {usmipc.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{info,demo}")
    sub.add_parser("info", help="list backends and devices (the default)")
    demo = sub.add_parser(
        "demo", help="share device memory with a child process and check it")
    demo.add_argument("--device", default=None,
                      help="filter string, e.g. host:cpu or cuda:gpu:0 "
                           "(default: the default device)")
    demo.add_argument("--nbytes", type=int, default=1 << 20,
                      help="size of the shared allocation (default 1 MiB)")
    demo.add_argument("--reopen", type=int, default=1000,
                      help="cached re-opens the child times (default 1000)")
    demo.add_argument("--warm", type=int, default=16,
                      help="further allocations exported and opened for the "
                           "warm figures (default 16)")
    demo.add_argument("--timeout", type=float, default=60.0,
                      help="seconds to wait for the child (default 60)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return cmd_demo(args)
    return cmd_info(args)


if __name__ == "__main__":
    sys.exit(main())
