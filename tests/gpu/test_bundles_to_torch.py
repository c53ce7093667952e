"""open_shared(..., to="torch") on the GPU: torch tensors made from the
bundle's capsules in C, with the producer's shapes, strides and dtypes,
the same bytes, writes seen by the producer, and the mapping held until the
last tensor dies."""
import multiprocessing

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import usmipc  # noqa: E402

TIMEOUT = 60


def _consumer(conn):
    try:
        _consume(conn)
    except BaseException:
        import traceback
        conn.send(("error", traceback.format_exc()))
        raise


def _consume(conn):
    import torch
    import usmipc
    torch.cuda.init()
    stream = torch.cuda.Stream()
    data = conn.recv()
    with torch.cuda.stream(stream):
        tree = usmipc.open_shared(data, stream=stream, to="torch")
        out = {k: (tuple(v.shape), tuple(v.stride()), str(v.dtype),
                   v.float().sum().item() if v.numel() else 0.0)
               for k, v in tree.items() if isinstance(v, torch.Tensor)}
        tree["w"].fill_(2)          # seen by the producer: no copy
        stream.synchronize()
    conn.send((out, type(tree["nested"]).__name__,
               type(tree["nested"][0]).__name__))
    conn.recv()
    del tree
    conn.send("closed")


def test_to_torch_round_trip():
    torch.cuda.init()
    dev = torch.device("cuda", 0)
    base = torch.randn(64, 96, device=dev, dtype=torch.bfloat16)
    tree = {"w": torch.zeros(1000, device=dev, dtype=torch.float32),
            "view": base[::2, 3:50],                  # strided, offset
            "t": base.t(),                            # transposed
            "i": torch.arange(10, device=dev, dtype=torch.int64),
            "empty": torch.empty(0, 7, device=dev, dtype=torch.float16),
            "nested": [torch.ones(3, device=dev, dtype=torch.bool)]}
    torch.cuda.synchronize()
    sums = {k: v.float().sum().item() for k, v in tree.items()
            if isinstance(v, torch.Tensor) and v.numel()}  # before the write
    bundle = usmipc.share(tree)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child,))
    proc.start()
    parent.send(bundle.to_bytes())
    assert parent.poll(TIMEOUT), f"consumer silent (exit code {proc.exitcode})"
    reply = parent.recv()
    assert reply[0] != "error", reply[1]
    got, nested, leaf = reply
    assert nested == "list" and leaf == "Tensor"
    for k, v in tree.items():
        if not isinstance(v, torch.Tensor):
            continue
        shape, stride, dtype, total = got[k]
        assert shape == tuple(v.shape), k
        assert dtype == str(v.dtype), k
        if v.numel():
            assert stride == tuple(v.stride()), k
            assert total == pytest.approx(sums[k], rel=1e-3), k
    torch.cuda.synchronize()
    assert tree["w"].eq(2).all().item()
    parent.send("drop")
    assert parent.poll(TIMEOUT) and parent.recv() == "closed"
    proc.join(TIMEOUT)
    assert proc.exitcode == 0
