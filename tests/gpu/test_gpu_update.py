"""UpdatePlan on CUDA: the batched copy kernel (and, with
USMIPC_COPY_BATCH=loop, the copy loop) moves every byte right whatever the
alignment: views at odd element offsets on both sides (the kernel's 16-byte,
4-byte and byte paths), sizes that are no multiple of 16, a column shard of
a wider matrix, a tensor of many chunks, one element, and an empty one.
Each case copies in this process (the producer's own bytes, opened here)
and is checked element for element."""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import usmipc  # noqa: E402


def _cases(dev):
    g = torch.Generator(device=dev).manual_seed(3)
    big = torch.randn(1_000_003, dtype=torch.bfloat16, device=dev,
                      generator=g)
    m = torch.randn(300, 257, dtype=torch.bfloat16, device=dev, generator=g)
    u8 = torch.randint(0, 255, (1_000_001,), dtype=torch.uint8, device=dev,
                       generator=g)
    huge = torch.randn(75_000_000, dtype=torch.float32, device=dev,
                       generator=g)  # 300 MB: many 1 MiB chunks
    src = {"a": big[1:500_001],          # 2 bytes past a 16-byte boundary
           "b": big[7:7 + 12_345],       # 14 bytes past
           "m": m, "u8": u8[1:], "huge": huge,
           "one": big[5:6].view(()), "empty": big[:0].view(0, 4)}
    buf = torch.zeros(2_000_000, dtype=torch.bfloat16, device=dev)
    wide = torch.zeros(300, 400, dtype=torch.bfloat16, device=dev)
    ubuf = torch.zeros(1_000_003, dtype=torch.uint8, device=dev)
    dst = {"a": buf[3:500_003],          # another alignment than the source
           "b": buf[600_000:612_345],    # the same modulo 16: 16-byte path
           "m": wide[:, 5:262],          # rows of 514 bytes, pitch 800
           "u8": ubuf[2:1_000_002],      # bytes
           "huge": torch.zeros_like(huge), "one": buf[-1:].view(()),
           "empty": buf[:0].view(0, 4)}
    return src, dst


def run_cases():
    dev = torch.device("cuda:0")
    src, dst = _cases(dev)
    bundle = usmipc.share(src, release=True)
    plan = usmipc.UpdatePlan(dst)
    s = torch.cuda.current_stream()
    for step in range(3):
        for t in src.values():
            if t.numel():
                t.add_(1)
        raw = bundle.to_bytes()
        before = usmipc.stats()
        plan.update(raw, stream=s)
        after = usmipc.stats()
        s.synchronize()
        for k in src:
            assert torch.equal(dst[k], src[k]), (k, step)
        if step > 0:
            assert after["driver_imports"] == before["driver_imports"]
        bundle.wait_released(stream=s)
    assert bundle.releases == (3, 3)
    return "ok"


def test_kernel_every_alignment():
    assert run_cases() == "ok"


def test_loop_fallback_every_alignment():
    env = dict(os.environ, USMIPC_COPY_BATCH="loop")
    r = subprocess.run([sys.executable, __file__], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok")


if __name__ == "__main__":
    print(run_cases())
