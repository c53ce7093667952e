"""Devices, filters, backends, queues and the error type."""

import pickle

import pytest

import usmipc


def test_get_devices_lists_the_host():
    devices = usmipc.get_devices()
    assert devices, "the host backend always has a device"
    assert all(isinstance(d, usmipc.Device) for d in devices)
    filters = [d.filter_string for d in devices]
    assert "host:cpu:0" in filters
    assert len(set(filters)) == len(filters)
    for d in devices:
        # the canonical filter string selects the device itself
        assert usmipc.Device(d.filter_string) is d


def test_host_device_attributes(host):
    assert host.backend == "host"
    assert host.device_type == "cpu"
    assert host.filter_string == "host:cpu:0"
    assert host.get_filter_string() == "host:cpu:0"
    assert host.index == 0
    assert isinstance(host.name, str) and host.name
    assert isinstance(host.uuid, bytes) and len(host.uuid) == 16
    assert host.has_aspect_ipc_memory is True
    assert host.has_aspect_ext_oneapi_ipc_memory is True
    assert "host:cpu:0" in repr(host)


def test_default_device():
    d = usmipc.Device()
    assert d == usmipc.Device(None) == usmipc.Device("")
    assert d in usmipc.get_devices()


@pytest.mark.parametrize("text", ["host", "host:cpu", "host:cpu:0", "cpu"])
def test_filters_name_the_same_device(text, host):
    d = usmipc.Device(text)
    assert d == host and hash(d) == hash(host)
    assert {d: 1}[host] == 1
    assert d != "host:cpu:0"  # a Device is not equal to its string


@pytest.mark.parametrize("text", [
    "nonsense", "HOST", "host:tpu", "host:cpu:x", "host:cpu:-1",
    "host:cpu:0:1", ":::",
])
def test_malformed_filter_is_value_error(text):
    with pytest.raises(ValueError) as info:
        usmipc.Device(text)
    e = info.value
    assert e.code == usmipc.USMIPC_EINVAL and e.name == "USMIPC_EINVAL"
    assert text in str(e)


def test_filter_with_nul_is_value_error():
    with pytest.raises(ValueError, match="NUL"):
        usmipc.Device("host\0:cpu")


def test_filter_of_wrong_type_is_type_error():
    with pytest.raises(TypeError):
        usmipc.Device(3)


def test_missing_device_is_usmipc_error():
    with pytest.raises(usmipc.Error) as info:
        usmipc.Device("host:cpu:7")
    e = info.value
    assert isinstance(e, RuntimeError)
    assert e.code == usmipc.USMIPC_ENODEV < 0
    assert e.name == "USMIPC_ENODEV"
    assert "host:cpu:7" in str(e)


def test_backends_report_availability_and_reasons():
    b = usmipc.backends()
    assert set(b) == {"host", "cuda", "level_zero"}
    assert b["host"] == (True, None)
    for name, (available, reason) in b.items():
        assert isinstance(available, bool)
        if available:
            assert reason is None
        else:
            assert isinstance(reason, str) and reason, name


def test_unavailable_backend_devices_are_not_listed():
    available = {n for n, (ok, _) in usmipc.backends().items() if ok}
    assert {d.backend for d in usmipc.get_devices()} <= available


def test_device_pickles_to_itself(host):
    assert pickle.loads(pickle.dumps(host)) is host


def test_queue(host):
    q = usmipc.Queue(host)
    assert q.device is host and q.sycl_device is host
    assert q.synchronize() is None
    assert usmipc.Queue().device == usmipc.Device()
    assert usmipc.Queue("host:cpu").device is host
    assert usmipc.Queue(sycl_device=host).device is host
    assert "host:cpu:0" in repr(q)
    with pytest.raises(TypeError):
        usmipc.Queue(host, sycl_device=host)
    with pytest.raises(ValueError):
        usmipc.Queue("bogus")


def test_error_type_and_codes():
    assert issubclass(usmipc.Error, RuntimeError)
    assert usmipc.errorcode[usmipc.USMIPC_EEXPORTERGONE] == \
        "USMIPC_EEXPORTERGONE"
    assert usmipc.USMIPC_EEXPORTERGONE == -30007
    assert all(code < 0 for code in usmipc.errorcode)
    assert usmipc.strerror(usmipc.USMIPC_EBADHANDLE) == "malformed IPC handle"
    assert usmipc.Error("x").code is None


def test_version_matches_compiled_library():
    major, minor, patch = (int(x) for x in usmipc.__version__.split("."))
    assert usmipc.VERSION_HEX == (major << 16) | (minor << 8) | patch
    assert usmipc.VERSION_HEX == usmipc.COMPILED_VERSION_HEX
