"""usmipc.UpdatePlan: a handoff copied into the consumer's own arrays in one
call, on host memory (the host backend's parallel memcpy): a process of its
own with differently laid-out weights (a column shard, a subset, paths
given three ways), warm rounds without driver work, tickets returned by the
update itself, and plans that do not fit refused before anything moves."""

import gc

import numpy as np
import pytest

import usmipc
from usmipc.memory import MemoryPool

from conftest import join_ok, recv_from, spawn_peer

HOST = "host:cpu"


def _producer_tree(pool):
    """Pool blocks as numpy views: a model-like tree."""
    def block(nbytes, dtype):
        return np.from_dlpack(pool.allocate(nbytes)).view(dtype)

    embed = block(10 * 100 * 4, np.float32).reshape(10, 100)
    w = block(8 * 8 * 8, np.int64).reshape(8, 8)
    b = block(64, np.float16)[:5]
    flags = block(7, np.bool_)
    big = block(40 << 20, np.uint8)  # past the 32 MiB threshold for threads
    tree = {"embed": embed, "layers": [{"w": w, "b": b}, (flags,)],
            "big": big, "ключ": embed[2:4, 10:20]}
    _fill(tree, 1)
    return tree


def _fill(tree, seed):
    rng = np.random.default_rng(seed)
    tree["embed"][:] = rng.standard_normal((10, 100), dtype=np.float32)
    tree["layers"][0]["w"][:] = rng.integers(-99, 99, (8, 8))
    tree["layers"][0]["b"][:] = rng.standard_normal(5).astype(np.float16)
    tree["layers"][1][0][:] = rng.integers(0, 2, 7).astype(bool)
    tree["big"][::4096] = rng.integers(0, 255, (40 << 20) // 4096)


def _leaves(tree, path=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, path + (i,))
    else:
        yield path, tree


def _consumer(conn):
    """Weights of its own: embed as a column shard of a wider matrix (rows
    of 100 in rows of 128), the rest contiguous; dest forms by message."""
    plan = weights = None
    while True:
        msg = conn.recv()
        if msg is None:
            return
        op, arg = msg
        try:
            if op == "plan":
                form, shapes = arg
                weights = {p: np.zeros(s, dtype=d) for p, (s, d) in
                           shapes.items()}
                wide = np.zeros((10, 128), np.float32)
                weights[("embed",)] = wide[:, :100]
                if form == "tree":
                    dest = {"embed": weights[("embed",)],
                            "layers": [{"w": weights[("layers", 0, "w")],
                                        "b": weights[("layers", 0, "b")]},
                                       (weights[("layers", 1, 0)],)],
                            "big": weights[("big",)],
                            "ключ": weights[("ключ",)]}
                elif form == "paths":
                    dest = dict(weights)
                else:
                    dest = [(p if len(p) > 1 else p[0], a)
                            for p, a in weights.items()]
                plan = usmipc.UpdatePlan(dest)
                conn.send(("ok", None))
            elif op == "update":
                plan.update(arg)
                conn.send(("ok", ({p: a.copy() for p, a in weights.items()},
                                  usmipc.stats())))
        except usmipc.Error as e:
            conn.send(("error", (type(e).__name__, e.name, str(e))))


@pytest.fixture
def consumer():
    conn, proc = spawn_peer(_consumer)

    def call(op, arg):
        conn.send((op, arg))
        return recv_from(conn, proc)

    yield call
    conn.send(None)
    join_ok(proc)


def _shapes(tree):
    return {p: (a.shape, a.dtype) for p, a in _leaves(tree)}


@pytest.mark.parametrize("form", ["tree", "paths", "pairs"])
def test_update_into_own_weights(consumer, form):
    pool = MemoryPool(device=usmipc.Device(HOST))
    tree = _producer_tree(pool)
    bundle = usmipc.share(tree, release=True)
    assert consumer("plan", (form, _shapes(tree)))[0] == "ok"
    imports = None
    for step in range(3):
        _fill(tree, 10 + step)  # the trainer's in-place update
        status, answer = consumer("update", bundle.to_bytes())
        assert status == "ok", answer
        got, stats = answer
        for path, src in _leaves(tree):
            np.testing.assert_array_equal(got[path], src, err_msg=str(path))
        if imports is not None:  # warm: nothing mapped anew
            assert stats["driver_imports"] == imports
        imports = stats["driver_imports"]
        # The update returned the ticket: the producer's wait ends.
        bundle.wait_released()
        assert bundle.releases == (step + 1, step + 1)


def test_refused_before_anything_moves():
    pool = MemoryPool(device=usmipc.Device(HOST))
    tree = _producer_tree(pool)
    bundle = usmipc.share(tree)  # kept: its bytes open while it lives
    data = bundle.to_bytes()
    embed = np.full((10, 100), 7, np.float32)
    # A wrong shape, after a destination that fits: neither is written.
    plan = usmipc.UpdatePlan({"embed": embed,
                              ("layers", 0, "w"): np.zeros((8, 7), np.int64)})
    with pytest.raises(usmipc.ArgumentError,
                       match=r"\['layers'\]\[0\]\['w'\].*shape \(8, 7\)"):
        plan.update(data)
    assert (embed == 7).all()
    # A wrong dtype.
    plan = usmipc.UpdatePlan({"embed": embed.view(np.int32)})
    with pytest.raises(usmipc.ArgumentError, match=r"\['embed'\].*dtype"):
        plan.update(data)
    # A path the bundle lacks.
    plan = usmipc.UpdatePlan({"embedding": embed})
    with pytest.raises(usmipc.ArgumentError,
                       match=r"no array at \['embedding'\]"):
        plan.update(data)
    # Elements that are not rows of contiguous elements (every other column).
    wide = np.zeros((10, 200), np.float32)
    plan = usmipc.UpdatePlan({"embed": wide[:, ::2]})
    with pytest.raises(usmipc.Error, match="not rows of contiguous") as e:
        plan.update(data)
    assert e.value.name == "USMIPC_ENOTSUP"
    assert (wide == 0).all()
    # Two destinations for one path; not an array.
    with pytest.raises(usmipc.ArgumentError, match="two destinations"):
        usmipc.UpdatePlan([("embed", embed), (("embed",), embed)])
    with pytest.raises(usmipc.Error, match=r"destination \['embed'\]"):
        usmipc.UpdatePlan({"embed": "not an array"}).update(data)
    with pytest.raises(usmipc.Error, match="bytes of a handoff"):
        usmipc.UpdatePlan({"embed": embed}).update(12345)


def test_tree_change_rebinds_unless_strict():
    pool = MemoryPool(device=usmipc.Device(HOST))
    tree = _producer_tree(pool)
    embed = np.zeros((10, 100), np.float32)
    loose = usmipc.UpdatePlan({"embed": embed})
    strict = usmipc.UpdatePlan({"embed": np.zeros((10, 100), np.float32)},
                               strict=True)
    bundle = usmipc.share(tree)
    data = bundle.to_bytes()
    loose.update(data)
    strict.update(data)
    np.testing.assert_array_equal(embed, tree["embed"])
    # The producer adds a leaf before "embed": every index moves.
    tree2 = {"extra": tree["layers"][0]["b"], **tree}
    tree["embed"][:] += 1
    bundle2 = usmipc.share(tree2)
    data2 = bundle2.to_bytes()
    loose.update(data2)
    np.testing.assert_array_equal(embed, tree["embed"])
    with pytest.raises(usmipc.ArgumentError, match="tree"):
        strict.update(data2)


def test_plan_keeps_destinations_alive():
    pool = MemoryPool(device=usmipc.Device(HOST))
    tree = _producer_tree(pool)
    bundle = usmipc.share(tree)
    data = bundle.to_bytes()
    dest = np.zeros((10, 100), np.float32)
    plan = usmipc.UpdatePlan({"embed": dest})
    plan.update(data)  # binds: the plan holds the destination from here on
    view = dest[:]  # survives below
    del dest
    gc.collect()
    tree["embed"][:] = 3
    plan.update(data)
    assert (view == 3).all()
    plan.close()
    plan.close()
    assert "not bound" in repr(plan)
