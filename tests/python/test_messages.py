"""Mistakes of a newcomer's first hour (issue 25): each gets a usmipc.Error
subclass that keeps the builtin base code may catch today, and a message
that says what to do in Python terms."""
import pickle

import numpy as np
import pytest

import usmipc
from usmipc.memory import IPCMemoryHandle, MemoryUSMDevice, host_array

HOST = usmipc.Device("host:cpu")


@pytest.fixture
def bundle_and_handle():
    b = usmipc.share({"w": host_array(np.ones(4))})
    m = MemoryUSMDevice(64, device=HOST)
    h = IPCMemoryHandle(m)
    yield b, b.to_bytes(), h, h.to_bytes(), m


def test_each_opener_names_the_other(bundle_and_handle):
    _, raw, _, hraw, _ = bundle_and_handle
    with pytest.raises(usmipc.ArgumentError,
                       match=r"bytes of a bundle.*usmipc\.open_shared"):
        IPCMemoryHandle.open(raw, HOST)
    with pytest.raises(usmipc.ArgumentError,
                       match=r"one IPC handle.*IPCMemoryHandle\.open"):
        usmipc.open_shared(hraw)


def test_wrong_types_are_argument_type_errors(bundle_and_handle):
    _, raw, _, _, m = bundle_and_handle
    with pytest.raises(usmipc.ArgumentTypeError, match="not a list"):
        usmipc.open_shared([1, 2, 3])  # once taken as 3 bytes
    with pytest.raises(TypeError):  # the builtin base stays
        usmipc.open_shared([1, 2, 3])
    with pytest.raises(usmipc.ArgumentTypeError, match="bytes-like.*not a list"):
        m.copy_from_host([1, 2])
    usmipc.open_shared(bytearray(raw))  # buffers still work
    usmipc.open_shared(memoryview(raw))


def test_closed_handle_and_lone_leaf(bundle_and_handle):
    _, raw, h, _, _ = bundle_and_handle
    h.close()
    with pytest.raises(usmipc.Error, match=r"closed.*IPCMemoryHandle\(mem\)") as e:
        h.to_bytes()
    assert isinstance(e.value, RuntimeError)  # as before
    tree = usmipc.open_shared(raw)
    with pytest.raises(usmipc.ArgumentTypeError,
                       match=r"not pickled on its own.*open_shared"):
        pickle.dumps(tree["w"])
    usmipc.close_shared(tree)


def test_words_and_sizes_agree(bundle_and_handle):
    """The trial's typos: 'a int', '1 allocations', and a repr saying
    '216-byte handle' of an ordered handle whose to_bytes() gives 288."""
    b, _, h, hraw, m = bundle_and_handle
    with pytest.raises(usmipc.ArgumentTypeError,
                       match=r"at \['x'\]: an int is not an array"):
        usmipc.share({"x": 3})
    with pytest.raises(usmipc.ArgumentTypeError,
                       match=r"at \['y'\]\[0\]: a float is not an array"):
        usmipc.share({"y": [1.5]})
    with pytest.raises(usmipc.ArgumentTypeError,
                       match=r"an int is not a shared array"):
        usmipc.close_shared([5])
    assert repr(b) == "<usmipc.SharedBundle of 1 array in 1 allocation>"
    two = usmipc.share([host_array(np.ones(2)), host_array(np.ones(3))])
    assert repr(two) == "<usmipc.SharedBundle of 2 arrays in 2 allocations>"
    assert len(hraw) == 288
    assert repr(h).endswith("216-byte handle, ordered: to_bytes() gives "
                            "288 bytes with its event record>")
    plain = IPCMemoryHandle(m, ordered=False)
    assert len(plain.to_bytes()) == 216
    assert repr(plain).endswith("; 216-byte handle>")


def test_no_caught_message_names_a_c_function():
    """conftest.py checks every exception a test catches with pytest.raises
    for the name of a C function of the library (the extension rewrites
    the library's C words into Python ones): the check itself fails on one,
    and the extension's words are Python's."""
    from conftest import _check_python_words
    try:  # not pytest.raises: its check would catch this message too
        _check_python_words(ValueError("open them with usmipc_ipc_open"))
    except pytest.fail.Exception as e:
        assert "names the C function usmipc_ipc_open" in str(e)
    else:
        raise AssertionError("the check let a C function's name through")
    _check_python_words(ValueError("USMIPC_IPC_TIMEOUT_MS, usmipc.Error"))
    m = MemoryUSMDevice(8, device=HOST)
    raw = bytearray(IPCMemoryHandle(m).to_bytes())
    raw[-1] ^= 1
    with pytest.raises(usmipc.Error) as info:
        IPCMemoryHandle.open(bytes(raw), HOST)
    assert "IPCMemoryHandle.to_bytes() produced" in str(info.value)
    assert "usmipc_" not in str(info.value)


def test_a_device_index_past_the_end_says_which_exist():
    with pytest.raises(usmipc.Error) as e:
        usmipc.Device("host:cpu:3")
    assert e.value.name == "USMIPC_ENODEV"
    assert "there is one such device, index 0" in str(e.value)
    with pytest.raises(usmipc.Error, match=r"no device matches 'host:gpu'; "
                       r"run 'python -m usmipc'"):
        usmipc.Device("host:gpu")
