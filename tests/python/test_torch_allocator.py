"""usmipc.memory.torch_allocator() and use_torch_allocator() without torch or
a GPU: the extension exports the entry points torch loads, the functions
hand torch the extension's path and names, refuse a torch that initialized
CUDA already, and import torch only when called. On a GPU machine with torch,
tests/gpu/test_gpu_torch_allocator.py runs the real thing."""

import ctypes

import pytest

import usmipc
import usmipc.memory

from conftest import run_python

# A stand-in for torch, enough for the allocator functions: it records what
# they ask of it. CUDA_INIT says whether torch "initialized CUDA" already.
FAKE_TORCH = r"""
import ctypes, sys, types
calls = []
torch = types.ModuleType("torch")
torch.cuda = types.ModuleType("torch.cuda")
torch.cuda.memory = types.ModuleType("torch.cuda.memory")
torch.cuda.is_initialized = lambda: CUDA_INIT
class CUDAPluggableAllocator:
    def __init__(self, path, alloc, free):
        lib = ctypes.CDLL(path)  # what torch does: dlopen, then dlsym
        getattr(lib, alloc), getattr(lib, free)
        self.args = (path, alloc, free)
        calls.append(("new", self.args))
def change_current_allocator(a):
    calls.append(("change", a.args))
    if REFUSE:
        raise RuntimeError("Can't swap an already initialized allocator")
torch.cuda.memory.CUDAPluggableAllocator = CUDAPluggableAllocator
torch.cuda.memory.change_current_allocator = change_current_allocator
sys.modules.update({"torch": torch, "torch.cuda": torch.cuda,
                    "torch.cuda.memory": torch.cuda.memory})
"""


def run_with_fake_torch(body, cuda_init=False, refuse=False):
    source = (f"CUDA_INIT = {cuda_init}\nREFUSE = {refuse}\n" + FAKE_TORCH +
              "import usmipc, usmipc.memory as m\n" + body)
    proc = run_python(source)
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode()


def test_extension_exports_the_torch_entry_points():
    lib = ctypes.CDLL(usmipc._usmipc.__file__)
    for name in ("usmipc_torch_malloc", "usmipc_torch_free",
                 "usmipc_torch_pool", "usmipc_torch_synchronize",
                 "usmipc_torch_set_segment_size"):
        assert hasattr(lib, name), name


def test_entry_points_through_ctypes():
    """What torch does with the functions, in a process of its own: size 0
    gives NULL, NULL frees; without a CUDA device an allocation gives NULL
    and the thread's last error says why, with one it gives a 512-byte
    aligned block."""
    out = run_python(r"""
        import ctypes, usmipc, usmipc.memory as m
        lib = ctypes.CDLL(usmipc._usmipc.__file__)
        malloc, free = lib.usmipc_torch_malloc, lib.usmipc_torch_free
        malloc.restype = ctypes.c_void_p
        malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                         ctypes.c_void_p]
        assert malloc(0, 0, None) is None
        free(None, 0, 0, None)
        p = malloc(1000, 0, None)
        if p is None:
            print("null", m.torch_last_error())
        else:
            assert p % 512 == 0, hex(p)
            free(p, 1000, 0, None)
            print("block", m.torch_pool_info(0)["blocks"])
    """)
    assert out.returncode == 0, out.stderr.decode()
    text = out.stdout.decode().strip()
    if text.startswith("null"):
        assert "usmipc_torch_malloc(1000 bytes, cuda device 0)" in text
    else:
        assert text == "block 0"


def test_torch_pool_info_without_cuda():
    if usmipc.backends()["cuda"][0]:
        pytest.skip("this machine has CUDA (tests/gpu covers it)")
    with pytest.raises(usmipc.Error) as e:
        usmipc.memory.torch_pool_info(0)
    assert e.value.name == "USMIPC_ENODEV"
    assert "no cuda device 0" in str(e.value)


def test_importing_usmipc_does_not_import_torch():
    out = run_python("""
        import sys, usmipc, usmipc.memory
        print("torch" in sys.modules)
    """)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().strip() == "False"


def test_torch_allocator_without_torch():
    # In a process where torch cannot be imported, installed or not (CI
    # installs it for test_distributed.py).
    out = run_python("""
        import sys
        sys.modules["torch"] = None  # import torch raises ImportError
        import usmipc.memory
        try:
            usmipc.memory.torch_allocator()
        except ImportError as e:
            print("ImportError", e)
    """)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().startswith("ImportError"), out.stdout


def test_use_torch_allocator_installs_the_extension_once():
    out = run_with_fake_torch("""
        a = m.use_torch_allocator()
        assert m.use_torch_allocator() is a and m.torch_allocator() is a
        assert calls == [("new", (usmipc._usmipc.__file__, "usmipc_torch_malloc",
                                  "usmipc_torch_free")),
                         ("change", a.args)], calls
        print("ok")
    """.replace("\n        ", "\n"))
    assert out.strip() == "ok"


def test_use_torch_allocator_after_cuda_init_is_refused():
    out = run_with_fake_torch("""
        try:
            m.use_torch_allocator()
        except RuntimeError as e:
            print(e)
        assert [c[0] for c in calls] == ["new"], calls
    """.replace("\n        ", "\n"), cuda_init=True)
    assert "before torch initializes CUDA" in out


def test_use_torch_allocator_explains_torch_refusal():
    out = run_with_fake_torch("""
        try:
            m.use_torch_allocator()
        except RuntimeError as e:
            print(e)
            print(type(e.__cause__).__name__)
        try:
            m.use_torch_allocator()  # not installed: asks torch again
        except RuntimeError:
            print("again")
    """.replace("\n        ", "\n"), refuse=True)
    assert "before any CUDA work" in out
    assert "Can't swap an already initialized allocator" in out
    assert "RuntimeError" in out and "again" in out
