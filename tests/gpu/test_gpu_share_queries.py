"""share() of PyTorch caching-allocator tensors asks the driver once per
allocation, never per tensor (issue 23, item 2), and proves by the buffer id
that an allocation is still the one it exported: a segment freed and
allocated again at the same address between two share() calls is exported
anew, and a consumer reads the new memory's bytes."""
import multiprocessing as mp

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import usmipc  # noqa: E402


def _segments(tensors):
    """How many caching-allocator segments hold the tensors."""
    segs = [(s["address"], s["total_size"])
            for s in torch.cuda.memory_snapshot()]
    found = set()
    for t in tensors:
        p = t.data_ptr()
        for base, size in segs:
            if base <= p < base + size:
                found.add(base)
    return len(found)


def test_one_query_per_allocation_none_per_tensor():
    # 600 tensors of 1 MiB: the caching allocator packs them into a few
    # 20 MiB segments.
    state = {f"w{i}": torch.full((1 << 19,), float(i % 7),
                                 dtype=torch.bfloat16, device="cuda")
             for i in range(600)}
    torch.cuda.synchronize()
    nseg = _segments(state.values())
    before = usmipc.stats()
    first = usmipc.share(state)
    mid = usmipc.stats()
    again = usmipc.share(state)
    after = usmipc.stats()
    assert first.allocations == nseg == again.allocations
    assert mid["driver_queries"] - before["driver_queries"] == nseg
    assert after["driver_queries"] - mid["driver_queries"] == nseg
    assert after["driver_exports"] == mid["driver_exports"]  # kept exports


def _reader(conn):
    tree = usmipc.open_shared(conn.recv())
    conn.send(float(torch.from_dlpack(tree["t"]).float().mean()))


def test_segment_freed_and_allocated_again_is_exported_anew():
    torch.cuda.empty_cache()
    t = torch.full((16 << 20,), 1.0, dtype=torch.float32, device="cuda")
    b1 = usmipc.share({"t": t})
    addr = t.data_ptr()
    del b1, t
    torch.cuda.empty_cache()  # the segment goes back to the driver
    t2 = torch.full((16 << 20,), 7.0, dtype=torch.float32, device="cuda")
    if t2.data_ptr() != addr:
        pytest.skip("the driver did not hand out the same address again")
    before = usmipc.stats()
    b2 = usmipc.share({"t": t2})
    after = usmipc.stats()
    assert after["driver_exports"] - before["driver_exports"] == 1
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_reader, args=(there,))
    proc.start()
    here.send(b2.to_bytes())
    assert here.poll(120)
    assert here.recv() == 7.0
    proc.join(60)
    assert proc.exitcode == 0
