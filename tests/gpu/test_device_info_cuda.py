"""Device.driver_version, global_mem_size and max_mem_alloc_size on a CUDA
device (usmipc_device_get_info: cuDriverGetVersion, cuDeviceTotalMem_v2),
compared with what torch and the driver itself say, and the dpctl parity
features on CUDA memory that the host suite cannot reach: DLPack to the CPU
and __sycl_usm_array_interface__ of a torch tensor's memory.

Runs only where a CUDA device and torch are present (tests/gpu/run.sh on the
device machine: its pytest-gpu step); skips elsewhere."""
import ctypes

import pytest

usmipc = pytest.importorskip("usmipc")
torch = pytest.importorskip("torch")
from usmipc.memory import MemoryUSMDevice, MemoryUSMHost  # noqa: E402

try:
    GPU = usmipc.Device("cuda:gpu:0")
except Exception as exc:  # pragma: no cover - CPU machines
    pytestmark = pytest.mark.skip(reason=f"no CUDA device: {exc}")
    GPU = None


def test_driver_version_as_sycl_prints_it():
    lib = ctypes.CDLL("libcuda.so.1")
    version = ctypes.c_int()
    assert lib.cuDriverGetVersion(ctypes.byref(version)) == 0
    v = version.value
    assert GPU.driver_version == f"CUDA {v // 1000}.{v % 1000 // 10}"


def test_memory_sizes_match_torch():
    props = torch.cuda.get_device_properties(0)
    assert GPU.global_mem_size == props.total_memory
    assert GPU.max_mem_alloc_size == props.total_memory


def test_print_device_info(capsys):
    GPU.print_device_info()
    out = capsys.readouterr().out
    assert f"Driver version  {GPU.driver_version}\n" in out
    assert f"Global memory   {GPU.global_mem_size} bytes" in out


def test_dlpack_to_the_cpu():
    np = pytest.importorskip("numpy")
    host = MemoryUSMHost(4096, device=GPU)  # pinned: kDLCUDAHost
    host.memset(3)
    a = np.from_dlpack(host, device="cpu")
    assert a.ctypes.data == host._pointer and int(a[100]) == 3
    dev = MemoryUSMDevice(4096, device=GPU)
    dev.memset(4)
    with pytest.raises(BufferError, match="copy=True"):
        np.from_dlpack(dev, device="cpu")
    c = np.from_dlpack(dev, device="cpu", copy=True)
    assert c.ctypes.data != dev._pointer and c.tobytes() == b"\x04" * 4096
    t = torch.from_dlpack(dev.__dlpack__(copy=True))  # a device copy
    assert t.is_cuda and t.data_ptr() != dev._pointer
    assert int(t[0]) == 4


def test_memory_of_a_torch_tensor_through_the_interface():
    t = torch.arange(256, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()

    class Wrapped:
        __sycl_usm_array_interface__ = {
            "data": (t.data_ptr(), False), "shape": (256,),
            "typestr": "|u1", "strides": None, "version": 1,
            "syclobj": GPU}
    view = MemoryUSMDevice(Wrapped())  # torch's memory, no copy
    assert view._pointer == t.data_ptr()
    assert view.tobytes() == bytes(range(256))
    view.memset(9)
    assert int(t[17]) == 9
