"""Objects that change what the extension is reading while it reads them.

share() walks the caller's dicts and lists and reads each leaf through
Python code (a property, __index__, __len__, __getitem__, a stream's
attributes, a __del__): that code may clear the container being walked,
delete the key being read, drop the last reference to the leaf, or close
the array being exported. The extension must hold its own references (or
copies) across every such call. Each case runs in a fresh interpreter
under PYTHONMALLOC=debug (freed memory is overwritten, so a read after
free shows), so that a crash fails the test instead of killing pytest;
`make test-python-asan` runs the same cases against an extension built
with AddressSanitizer and UBSan (USMIPC_TEST_ASAN=1)."""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import TIMEOUT

# What every case starts with: host memory (usmipc's own, so that share()
# takes it) and a leaf class whose __cuda_array_interface__ property runs a
# hook first.
PRELUDE = """
import gc, sys
import numpy as np
import usmipc
from usmipc.memory import MemoryPool
pool = MemoryPool(device=usmipc.Device("host:cpu"))

def host_array(n=64):
    return np.from_dlpack(pool.allocate(n))

class Leaf:
    '''An array of n bytes of host memory; hook() runs at each read.'''
    def __init__(self, hook=None, n=64, shape=None, strides=None):
        self.a = host_array(n)
        self.hook = hook
        self.shape = shape if shape is not None else (n,)
        self.strides = strides
    @property
    def __cuda_array_interface__(self):
        if self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return {"data": (self.a.ctypes.data, False), "shape": self.shape,
                "typestr": "|u1", "strides": self.strides, "version": 3}
"""


def run_case(body, expect="OK"):
    """Runs PRELUDE + body in a fresh interpreter; it must exit 0 and print
    expect as its last line."""
    env = dict(os.environ, PYTHONMALLOC="debug", PYTHONFAULTHANDLER="1",
               PYTHONDONTWRITEBYTECODE="1")
    if os.environ.get("USMIPC_TEST_ASAN") == "1":
        # make test-python-asan: libasan is preloaded (LD_PRELOAD, inherited)
        # and every object is malloc'd, so that ASan sees each one.
        env["PYTHONMALLOC"] = "malloc"
    r = subprocess.run([sys.executable, "-c",
                        PRELUDE + textwrap.dedent(body)],
                       capture_output=True, text=True, timeout=TIMEOUT,
                       env=env)
    out = r.stdout.strip().splitlines()
    assert r.returncode == 0 and out and out[-1] == expect, (
        f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}")


# ---- share(): the tree walk --------------------------------------------------

def test_leaf_clears_the_list_being_walked():
    # Before: PyList_GetItem of the next index returned NULL (the list was
    # empty by then) and Py_INCREF(NULL) crashed.
    run_case("""
        tree = []
        tree.extend([Leaf(tree.clear), Leaf(), Leaf()])
        b = usmipc.share(tree, ordered=False)
        assert b.arrays == 3, b.arrays
        print("OK")
    """)


def test_leaf_deletes_its_own_key():
    # Before: the key's UTF-8 (owned by the str the dict held) was read
    # after the str was freed: "not valid UTF-8", or garbage as the key.
    run_case("""
        tree = {}
        key = "".join(["weight_", str(12345)])
        tree[key] = Leaf(lambda: tree.pop("weight_12345"))
        del key
        b = usmipc.share(tree, ordered=False)
        opened = usmipc.open_shared(b.to_bytes())
        assert list(opened) == ["weight_12345"], list(opened)
        print("OK")
    """)


def test_leaf_clears_the_dict_holding_its_only_reference():
    # Before: the leaf (and its array) was freed while being read: SIGSEGV.
    run_case("""
        tree = {}
        tree["a"] = Leaf(tree.clear, n=4096)
        tree["b"] = Leaf()
        b = usmipc.share(tree, ordered=False)
        assert b.arrays == 2, b.arrays
        print("OK")
    """)


def test_leaf_drops_the_nested_container_being_walked():
    # A leaf deep in the tree replaces the inner dict (the only reference)
    # while the walk is inside it.
    run_case("""
        tree = {"outer": {"x": None, "y": Leaf()}}
        tree["outer"]["x"] = Leaf(lambda: tree.update(outer=None))
        b = usmipc.share(tree, ordered=False)
        assert b.arrays == 2, b.arrays
        print("OK")
    """)


def test_interface_shape_clears_the_interface_dict():
    # Before: 'strides' (borrowed from the interface dict) was read after
    # the shape's __len__ cleared the dict: a freed tuple.
    run_case("""
        class Shape:
            def __init__(self): self.d = None
            def __len__(self):
                if self.d is not None:
                    d, self.d = self.d, None
                    d.clear()
                return 1
            def __getitem__(self, i):
                if i >= 1: raise IndexError(i)
                return 64
        shape = Shape()
        class L(Leaf):
            @property
            def __cuda_array_interface__(self):
                d = {"data": (self.a.ctypes.data, False), "shape": shape,
                     "typestr": "|u1", "strides": tuple([1]), "version": 3}
                shape.d = d
                return d
        b = usmipc.share({"w": L()}, ordered=False)
        assert b.arrays == 1
        print("OK")
    """)


def test_interface_key_comparison_clears_the_interface_dict():
    # A key whose hash equals "strides"' and whose __eq__ clears the dict:
    # looking up "strides" runs it after "data", "shape" and "typestr"
    # were read from the dict (before: borrowed, then freed).
    run_case("""
        class Key:
            def __init__(self): self.d = None
            def __hash__(self): return hash("strides")
            def __eq__(self, other):
                if self.d is not None:
                    d, self.d = self.d, None
                    d.clear()
                return False
        key = Key()
        class L(Leaf):
            @property
            def __cuda_array_interface__(self):
                # a fresh typestr: a str the dict alone holds (freed, not
                # kept on a free list as small tuples are)
                d = {key: 0, "data": (int(self.a.ctypes.data), False),
                     "shape": (64,), "typestr": "".join(["|u", "1"]),
                     "version": 3}
                key.d = d
                return d
        try:
            usmipc.share({"w": L()}, ordered=False)
            print("shared")
        except TypeError as e:
            print("refused")
        print("OK")
    """)


def test_leaf_type_changes_while_its_kind_is_found():
    # Before: the leaf's type (borrowed from the object) was used after an
    # attribute read whose code re-classed the object and collected the
    # old class: a read of a freed type.
    run_case("""
        class Plain:
            pass
        def make():
            class T:
                __module__ = "torch.fake"  # read as a torch tensor
                def __getattr__(self, name):
                    if name == "data_ptr":
                        self.__class__ = Plain
                        gc.collect()
                    raise AttributeError(name)
            return T()
        tree = {"x": make()}
        try:
            usmipc.share(tree, ordered=False)
            print("shared")
        except TypeError as e:
            assert "Plain is not an array" in str(e), e
        print("OK")
    """)


# ---- share(): a torch tensor's layout, from torch's C code --------------------

def test_torch_tensor_that_rebinds_its_readers_shares_its_own_bytes():
    # share() reads a torch tensor's dtype, shape, stride() and data_ptr()
    # through torch._C.TensorBase's own readers, and any TensorBase is a
    # torch tensor to it. Before: a subclass defined outside a torch module
    # was read through __cuda_array_interface__ (refused on the CPU), and a
    # tensor given a data_ptr attribute of its own was read by that name,
    # sharing other bytes than the tensor's (silently: both lie inside one
    # allocation).
    pytest.importorskip("torch")
    run_case("""
        import torch
        from usmipc.memory import MemoryUSMDevice
        mem = MemoryUSMDevice(4096, device=usmipc.Device("host:cpu"))
        base = torch.from_dlpack(mem).view(torch.int32)
        base.copy_(torch.arange(1024, dtype=torch.int32))
        class Lying(torch.Tensor):
            def data_ptr(self):
                return super().data_ptr() + 8
            def stride(self, *args):
                return (1, 1)
        t = base[16:32].view(4, 4).as_subclass(Lying)
        u = base[100:104]
        u.data_ptr = lambda: base.data_ptr()
        b = usmipc.share({"t": t, "u": u}, ordered=False)
        tree = usmipc.open_shared(b.to_bytes(), to="torch")
        assert tree["t"].tolist() == base[16:32].view(4, 4).tolist(), tree
        assert tree["u"].tolist() == [100, 101, 102, 103], tree
        print("OK")
    """)


def test_torch_lookalike_before_torch_is_imported():
    # An object of a type in a "torch." module (read by name: it is no
    # TensorBase) shared before torch is imported: share() imports nothing
    # for it, and a real tensor shared after torch's import is still read
    # through torch's own readers (the search is made again).
    pytest.importorskip("torch")
    run_case("""
        from usmipc.memory import MemoryUSMDevice
        mem = MemoryUSMDevice(4096, device=usmipc.Device("host:cpu"))
        words = np.from_dlpack(mem).view(np.int32)
        words[:] = np.arange(1024)
        class DType:
            def __str__(self):
                return "torch.int32"
        class Fake:
            __module__ = "torch.fake"
            dtype = DType()
            shape = (4,)
            def stride(self):
                return (1,)
            def data_ptr(self):
                return int(words.ctypes.data) + 32
        b = usmipc.share({"f": Fake()}, ordered=False)
        assert "torch" not in sys.modules
        got = usmipc.open_shared(b.to_bytes())["f"]
        assert np.from_dlpack(got).tolist() == [8, 9, 10, 11]
        import torch
        base = torch.from_dlpack(mem).view(torch.int32)
        class Lying(torch.Tensor):
            def data_ptr(self):
                return 0
        t = base[40:44].as_subclass(Lying)
        b = usmipc.share({"f": Fake(), "t": t}, ordered=False)
        tree = usmipc.open_shared(b.to_bytes(), to="torch")
        assert tree["t"].tolist() == [40, 41, 42, 43], tree
        assert tree["f"].tolist() == [8, 9, 10, 11], tree
        print("OK")
    """)


def test_torch_readers_of_another_kind_are_read_by_name():
    # A torch whose TensorBase readers are not the C descriptors usmipc
    # expects (here a stand-in torch._C whose TensorBase is a Python class:
    # properties and functions) is read by name, reader by reader, and its
    # tensors still share: the direct path is only taken where it was
    # checked to apply.
    run_case("""
        import types
        from usmipc.memory import MemoryUSMDevice
        mem = MemoryUSMDevice(4096, device=usmipc.Device("host:cpu"))
        words = np.from_dlpack(mem).view(np.int32)
        words[:] = np.arange(1024)
        class DType:
            def __str__(self):
                return "torch.int32"
        class TensorBase:
            def __init__(self, at, n):
                self.at, self.n = at, n
            @property
            def dtype(self):
                return DType()
            @property
            def shape(self):
                return (self.n,)
            def stride(self):
                return (1,)
            def data_ptr(self):
                return int(words.ctypes.data) + 4 * self.at
        torch = types.ModuleType("torch")
        torch._C = types.ModuleType("torch._C")
        torch._C.TensorBase = TensorBase
        sys.modules["torch"], sys.modules["torch._C"] = torch, torch._C
        class Tensor(TensorBase):
            pass
        b = usmipc.share({"a": Tensor(16, 4), "b": TensorBase(100, 3)},
                         ordered=False)
        got = usmipc.open_shared(b.to_bytes())
        assert np.from_dlpack(got["a"]).tolist() == [16, 17, 18, 19]
        assert np.from_dlpack(got["b"]).tolist() == [100, 101, 102]
        print("OK")
    """)


# ---- SharedArray: Python code between the open check and the export --------

def test_dlpack_argument_closes_the_array():
    # Before: __dlpack__ checked that the array is open, then read its
    # arguments (__index__, __bool__: Python code that closed it) and made
    # a capsule of the closed, unmapped array.
    run_case("""
        src = host_array(64)
        b = usmipc.share({"w": src}, ordered=False)
        arr = usmipc.open_shared(b.to_bytes())["w"]
        class Dev:
            def __index__(self):
                arr.close()
                return 0
        for kwargs in ({"dl_device": (1, Dev())},
                       {"max_version": (Dev(),)}):
            arr = usmipc.open_shared(b.to_bytes())["w"]
            try:
                arr.__dlpack__(**kwargs)
                print("exported a closed array")
                sys.exit(1)
            except ValueError as e:
                assert "closed" in str(e), e
        print("OK")
    """)


def test_release_stream_drops_the_tree():
    # release_shared(tree, stream=S): S's attributes run Python code that
    # drops the tree (the only reference to its arrays and their ticket).
    # A guard, not a reproduction: on the host such a stream is refused
    # right after its code ran, so the old code never used the freed
    # ticket here; a CUDA stream (torch's, CuPy's) would go on to send it.
    run_case("""
        src = host_array(64)
        b = usmipc.share({"w": src, "v": host_array(8)}, ordered=False,
                         release=True)
        raw = b.to_bytes()
        holder = [usmipc.open_shared(raw)]
        class Stream:
            def __cuda_stream__(self):
                holder.clear()
                gc.collect()
                return (0, 0)
        try:
            usmipc.release_shared(holder[0], stream=Stream())
        except Exception as e:
            print(type(e).__name__, e)
        holder2 = [usmipc.open_shared(raw)]
        class Stream2:
            def __cuda_stream__(self):
                holder2.clear()
                gc.collect()
                return (0, 0)
        try:
            usmipc.release_shared(raw, stream=Stream2())
        except Exception as e:
            print(type(e).__name__, e)
        print("OK")
    """)


# ---- interface readers: a value read twice through Python code -------------

def test_sycl_interface_extent_is_read_once():
    # Before: each C-contiguous extent went through __index__ twice (once
    # checked, once multiplied), so the checked value need not be the one
    # used: here 4 then 0, an empty copy reported as done.
    run_case("""
        from usmipc.memory import MemoryUSMDevice
        q = usmipc.Queue(usmipc.Device("host:cpu"))
        base = MemoryUSMDevice(64, queue=q)
        base.copy_from_host(bytes(range(64)))
        calls = []
        class Extent:
            def __index__(self):
                calls.append(1)
                return 4 if len(calls) == 1 else 0
        class Arr:
            __sycl_usm_array_interface__ = dict(
                data=(base._pointer, False), shape=(Extent(), 2),
                typestr="|u1", strides=None, offset=0, version=1,
                syclobj=q)
        dst = MemoryUSMDevice(64, queue=q)
        dst.memset(0)
        dst.copy_from_device(Arr())
        assert len(calls) == 1, len(calls)
        assert dst.tobytes()[:8] == bytes(range(8)), dst.tobytes()[:8]
        print("OK")
    """)
