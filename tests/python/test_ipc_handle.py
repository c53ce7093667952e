"""IPCMemoryHandle in one process, and as importer of a helper's export:
export checks, pickling, the wire format's defences, closing rules."""

import gc
import os
import pickle
import threading

import pytest

import usmipc
from usmipc.memory import (IPCMemoryHandle, MemoryIPCDevice, MemoryUSMDevice,
                           MemoryUSMHost, MemoryUSMShared, _Memory,
                           is_ipc_available)

from conftest import MAGIC, is_known, pattern, reseal


@pytest.fixture
def exported(host):
    mem = MemoryUSMDevice(4096, device=host)
    mem.copy_from_host(pattern(4096, 1))
    return mem, IPCMemoryHandle(mem)


# ---- exporting -------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda d: MemoryUSMHost(64, device=d),
    lambda d: MemoryUSMShared(64, device=d),
    lambda d: b"bytes are not device memory",
    lambda d: bytearray(64),
    lambda d: None,
    lambda d: d,
])
def test_only_device_memory_can_be_exported(make, host):
    with pytest.raises(TypeError):
        IPCMemoryHandle(make(host))


def test_handle_metadata(exported, host):
    mem, _ = exported
    h = IPCMemoryHandle(mem, ordered=False)  # stable bytes, no event
    raw = h.to_bytes()
    assert isinstance(raw, bytes) and bytes(h) == raw
    assert raw.startswith(MAGIC)
    assert int.from_bytes(raw[8:10], "little") == 2  # version
    assert int.from_bytes(raw[10:12], "little") == len(raw)
    assert len(raw) == 216  # a host handle has no payload
    assert h.nbytes == 4096 and h.offset == 0 and h.allocation_size == 4096
    assert h.memory is mem and h.device is host
    assert h.backend == "host" and h.device_uuid == host.uuid
    assert h.exporter_pid == os.getpid()
    info = IPCMemoryHandle.inspect(raw)
    assert info == IPCMemoryHandle.inspect(h)
    assert info["exporter_pid"] == os.getpid()
    assert info["nbytes"] == 4096 and info["offset"] == 0
    assert info["device_uuid"] == host.uuid and info["length"] == len(raw)
    assert info["buffer_id"] == h.buffer_id
    assert info["is_ordered"] is False and info["is_event"] is False
    assert info["event_point"] == 0
    assert "4096 bytes" in repr(h) and "ordered" not in repr(h)
    assert h.ordered is False and h.queue is None


def test_handle_keeps_the_memory_alive(host):
    mem = MemoryUSMDevice(64, device=host)
    mem.copy_from_host(b"kept")
    address = mem._pointer
    h = IPCMemoryHandle(mem)
    del mem
    gc.collect()
    assert is_known(address)
    with IPCMemoryHandle.open(h.to_bytes(), host) as alias:
        assert bytes(alias.copy_to_host())[:4] == b"kept"
    del h
    gc.collect()
    assert not is_known(address)


def test_interior_range(host):
    mem = MemoryUSMDevice(4096, device=host)
    mem.copy_from_host(pattern(4096, 1))
    h = IPCMemoryHandle(mem, offset=100, nbytes=50)
    assert (h.offset, h.nbytes, h.allocation_size) == (100, 50, 4096)
    m = IPCMemoryHandle.open(h.to_bytes())
    assert m.nbytes == 50
    assert bytes(m.copy_to_host()) == pattern(4096, 1)[100:150]
    assert m._pointer == mem._pointer + 100
    m.close()
    for offset, nbytes in [(-1, None), (4096, None), (0, 4097), (4000, 97),
                           (0, 0)]:
        with pytest.raises(ValueError):
            IPCMemoryHandle(mem, offset=offset, nbytes=nbytes)


def test_availability(host):
    assert IPCMemoryHandle.is_available() is True
    assert is_ipc_available() == usmipc.Device().has_aspect_ipc_memory
    assert is_ipc_available(host) is True
    assert is_ipc_available("host:cpu") is True


# ---- pickling --------------------------------------------------------------


@pytest.mark.parametrize("ordered", [True, False])
def test_pickle_round_trip(ordered, exported, host):
    mem, _ = exported
    h = IPCMemoryHandle(mem, ordered=ordered)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        h2 = pickle.loads(pickle.dumps(h, protocol=protocol))
        assert type(h2) is IPCMemoryHandle
        assert h2.ordered is ordered
        # an ordered handle pickles a handoff each time (a fresh record,
        # or on an idle queue the latest, complete); the copy carries those
        # bytes as they are
        assert h2.to_bytes() == h2.to_bytes()
        assert IPCMemoryHandle.inspect(h2.to_bytes())["is_ordered"] is ordered
        if not ordered:
            assert h2.to_bytes() == h.to_bytes()
        assert h2 == h and hash(h2) == hash(h)
        assert h2.memory is None  # only the bytes travel
        assert h2.nbytes == 4096 and h2.device is host
        m = IPCMemoryHandle.open(h2)
        assert bytes(m.copy_to_host()) == pattern(4096, 1)
        m.close()


def test_from_bytes_validates():
    with pytest.raises(ValueError):
        IPCMemoryHandle.from_bytes(b"not a handle")
    with pytest.raises(ValueError):
        pickle.loads(pickle.dumps(IPCMemoryHandle.from_bytes))(b"x")


# ---- opening in the same process -------------------------------------------


def test_same_process_open_is_a_usable_alias(exported, host):
    mem, h = exported
    raw = h.to_bytes()
    m = IPCMemoryHandle.open(raw, host, nbytes=None)
    assert isinstance(m, MemoryIPCDevice) and isinstance(m, _Memory)
    assert m.kind == "device" and m.nbytes == 4096
    assert m.device is host and m.queue.device is host
    assert m.is_closed is False
    assert m._pointer == mem._pointer  # the exporter gets its own pointer
    assert bytes(m.copy_to_host()) == pattern(4096, 1)
    m.copy_from_host(b"alias")
    assert bytes(mem.copy_to_host())[:5] == b"alias"
    IPCMemoryHandle.close_mapping(m)
    assert m.is_closed and "closed" in repr(m)
    assert mem.tobytes()[:5] == b"alias"  # the original is untouched


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview,
                                  IPCMemoryHandle.from_bytes])
def test_open_accepts_bytes_like_and_handles(wrap, exported):
    mem, h = exported
    with IPCMemoryHandle.open(wrap(h.to_bytes())) as m:
        assert bytes(m.copy_to_host()) == pattern(4096, 1)
    assert m.is_closed


def test_open_device_argument_forms(exported, host):
    _, h = exported
    for device in (host, "host:cpu", usmipc.Queue(host), None):
        m = IPCMemoryHandle.open(h, device)
        assert m.device is host
        m.close()
    m = IPCMemoryHandle.open(handle=h, device=host, nbytes=16)
    assert m.nbytes == 16
    m.close()
    with pytest.raises(TypeError):
        IPCMemoryHandle.open()
    with pytest.raises(TypeError):
        IPCMemoryHandle.open(h, bogus=1)
    with pytest.raises(TypeError):
        IPCMemoryHandle.open(12345)


def test_nbytes_larger_than_exported_is_value_error(exported, host):
    _, h = exported
    with pytest.raises(ValueError) as info:
        IPCMemoryHandle.open(h.to_bytes(), host, nbytes=4097)
    assert info.value.name == "USMIPC_ERANGE"
    assert "4096" in str(info.value)
    for bad in (0, -5):
        with pytest.raises(ValueError):
            IPCMemoryHandle.open(h.to_bytes(), host, nbytes=bad)


# ---- malformed handle bytes -------------------------------------------------


def _open_error(data, host):
    with pytest.raises(ValueError) as info:
        IPCMemoryHandle.open(data, host)
    e = info.value
    assert str(e), "the message says what was wrong"
    assert e.code < 0 and e.name.startswith("USMIPC_E")
    return e


def test_truncated_handles(exported, host):
    raw = exported[1].to_bytes()
    for n in (0, 1, 7, 8, 11, 12, 100, len(raw) - 4, len(raw) - 1):
        e = _open_error(raw[:n], host)
        assert e.name == "USMIPC_EBADHANDLE", (n, e)
    e = _open_error(raw + b"\0", host)  # padded: the length field disagrees
    assert e.name == "USMIPC_EBADHANDLE"


def test_every_single_bit_flip_is_refused(exported, host):
    raw = exported[1].to_bytes()
    for i in range(len(raw)):
        for bit in (0, 7):
            flipped = bytearray(raw)
            flipped[i] ^= 1 << bit
            e = _open_error(bytes(flipped), host)
            assert e.name in ("USMIPC_EBADHANDLE",
                              "USMIPC_EHANDLEVERSION"), (i, bit, e)
            with pytest.raises(ValueError):
                IPCMemoryHandle.inspect(bytes(flipped))


def test_wrong_magic(exported, host):
    raw = exported[1].to_bytes()
    e = _open_error(b"\x89USMIPX\n" + raw[8:], host)
    assert e.name == "USMIPC_EBADHANDLE" and "magic" in str(e)
    e = _open_error(reseal(b"PK\x03\x04\0\0\0\0" + raw[8:]), host)
    assert e.name == "USMIPC_EBADHANDLE"


def test_version_bump(exported, host):
    raw = bytearray(exported[1].to_bytes())
    raw[8:10] = (3).to_bytes(2, "little")
    for data in (bytes(raw), reseal(raw)):  # with and without a fixed CRC
        e = _open_error(data, host)
        assert e.name == "USMIPC_EHANDLEVERSION"
        assert "version 3" in str(e)


def test_edited_fields_with_a_valid_checksum(exported, host):
    raw = exported[1].to_bytes()
    # nbytes (offset 144) beyond the allocation: resealed, still refused
    edited = bytearray(raw)
    edited[144:152] = (1 << 40).to_bytes(8, "little")
    _open_error(reseal(edited), host)
    # another boot id (offset 48): a handle from another host
    if not os.access("/proc/sys/kernel/random/boot_id", os.R_OK):
        pytest.skip("no boot id here: the library cannot tell hosts apart")
    edited = bytearray(raw)
    edited[48] ^= 0xFF
    e = _open_error(reseal(edited), host)
    assert e.name == "USMIPC_EOTHERHOST"


# ---- closing ------------------------------------------------------------------


def test_close_mapping_is_idempotent_and_final(exported, host):
    mem, h = exported
    m = IPCMemoryHandle.open(h, host)
    IPCMemoryHandle.close_mapping(m)
    IPCMemoryHandle.close_mapping(m)
    m.close()
    assert m.is_closed
    for op in (m.copy_to_host, m.tobytes, m.memset,
               lambda: m.copy_from_host(b"x"),
               lambda: m.copy_to_host(bytearray(4096)),
               lambda: memoryview(m), lambda: IPCMemoryHandle(m)):
        with pytest.raises(ValueError, match="mapping is closed"):
            op()
    # As dpctl's MemoryIPCDevice: a closed mapping reports no memory.
    assert m.nbytes == 0 and m._pointer == 0 and m.device is host


def test_close_mapping_takes_only_mappings(exported):
    mem, h = exported
    # Memory that is no mapping: RuntimeError, as dpctl raises.
    with pytest.raises(usmipc.Error, match="non-IPC memory"):
        IPCMemoryHandle.close_mapping(mem)
    for obj in (h, h.to_bytes(), None):
        with pytest.raises(TypeError):
            IPCMemoryHandle.close_mapping(obj)


def test_close_with_a_live_memoryview_defers_the_unmap(exporter,
                                                       no_ipc_cache):
    m = IPCMemoryHandle.open(exporter.raw)
    address = m._pointer
    view = memoryview(m)
    IPCMemoryHandle.close_mapping(m)  # must not fail ...
    assert m.is_closed
    with pytest.raises(ValueError):
        memoryview(m)
    assert is_known(address)  # ... nor unmap under the view
    assert bytes(view[:16]) == pattern(16, 1)
    view[0] = 0xEE
    assert exporter.dump()[0] == 0xEE
    view.release()
    assert not is_known(address)  # the last release unmapped it
    del m
    gc.collect()


def test_close_with_a_live_numpy_array(exporter, no_ipc_cache):
    np = pytest.importorskip("numpy")
    m = IPCMemoryHandle.open(exporter.raw)
    address = m._pointer
    a = np.asarray(m)
    b = np.frombuffer(m, dtype=np.uint32)
    m.close()
    assert is_known(address)
    a[1] = 0xDD
    assert exporter.dump()[1] == 0xDD
    del a
    gc.collect()
    assert is_known(address)  # b still holds an export
    assert b.nbytes == exporter.nbytes
    del b
    gc.collect()
    assert not is_known(address)


def test_garbage_collected_mapping_is_closed(exporter, no_ipc_cache):
    m = IPCMemoryHandle.open(exporter.raw)
    address = m._pointer
    assert is_known(address)
    del m
    gc.collect()
    assert not is_known(address)


def test_cross_process_mapping_reads_and_writes(exporter):
    with IPCMemoryHandle.open(exporter.raw) as m:
        assert m.nbytes == exporter.nbytes
        assert bytes(m.copy_to_host()) == pattern(exporter.nbytes, 1)
        m.copy_from_host(pattern(exporter.nbytes, 2))
        assert exporter.dump() == pattern(exporter.nbytes, 2)
        np = pytest.importorskip("numpy")
        a = np.asarray(m)
        a[:4] = 7
        del a
    assert exporter.dump()[:5] == b"\x07\x07\x07\x07" + \
        pattern(exporter.nbytes, 2)[4:5]


def test_concurrent_open_close(exporter):
    errors = []

    def worker():
        try:
            for _ in range(2000):
                m = IPCMemoryHandle.open(exporter.raw)
                if m.nbytes != exporter.nbytes:
                    errors.append(m.nbytes)
                IPCMemoryHandle.close_mapping(m)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_concurrent_copy_and_close(exporter):
    """Closing while other threads copy (without the GIL) must neither fail
    nor unmap under them: each operation either completes or raises the
    closed error."""
    for _ in range(20):
        m = IPCMemoryHandle.open(exporter.raw)
        results = []

        def reader():
            for _ in range(50):
                try:
                    results.append(bytes(m.copy_to_host()) ==
                                   pattern(exporter.nbytes, 1))
                except ValueError as e:
                    results.append("closed" in str(e))
                    return
                except Exception as e:  # anything else fails the test
                    results.append(e)
                    return

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        m.close()
        for t in threads:
            t.join()
        assert results and all(r is True for r in results), results


# ---- re-exporting and devices without IPC -----------------------------------


def test_reexport_of_a_same_process_alias(exported, host):
    mem, h = exported
    with IPCMemoryHandle.open(h) as alias:
        again = IPCMemoryHandle(alias)
        assert again.nbytes == 4096
        with IPCMemoryHandle.open(again) as m:
            assert bytes(m.copy_to_host()) == pattern(4096, 1)


def test_reexport_of_another_process_mapping_is_refused(exporter):
    with IPCMemoryHandle.open(exporter.raw) as m:
        with pytest.raises(usmipc.Error) as info:
            IPCMemoryHandle(m)
    assert info.value.name == "USMIPC_ENOTSUP"
    assert "original handle" in str(info.value)


def test_device_without_ipc_is_usmipc_error():
    devices = [d for d in usmipc.get_devices()
               if not d.has_aspect_ipc_memory]
    if not devices:
        pytest.skip("every device here supports IPC memory")
    mem = MemoryUSMDevice(64, device=devices[0])
    with pytest.raises(usmipc.Error) as info:
        IPCMemoryHandle(mem)
    assert info.value.name == "USMIPC_ENOTSUP"
    assert is_ipc_available(devices[0]) is False
