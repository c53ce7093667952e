"""Every public function, method, classmethod and property of the package
has a docstring that help() shows (a bound classmethod of C types had none
under CPython 3.11 while it was a PyCMethod)."""
import inspect

import usmipc
import usmipc.distributed
import usmipc.ipc
import usmipc.memory


def public_callables():
    for modname, mod in (("usmipc", usmipc), ("usmipc.memory", usmipc.memory),
                         ("usmipc.ipc", usmipc.ipc),
                         ("usmipc.distributed", usmipc.distributed)):
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name)
            if inspect.isclass(obj):
                if issubclass(obj, BaseException):
                    continue
                for attr in vars(obj):
                    if attr.startswith("_"):
                        continue
                    yield f"{modname}.{name}.{attr}", getattr(obj, attr, None)
            elif callable(obj):
                yield f"{modname}.{name}", obj


def test_every_public_callable_has_a_docstring():
    missing = [where for where, obj in public_callables()
               if callable(obj) and not (getattr(obj, "__doc__", None) or "").strip()]
    assert not missing, f"no docstring: {missing}"


def test_classmethod_help_shows_the_text():
    text = usmipc.memory.IPCMemoryHandle.open.__doc__
    assert "MemoryIPCDevice" in text
    assert str(inspect.signature(usmipc.memory.IPCMemoryHandle.open)) == \
        "(handle_bytes, device=None, nbytes=None, *, stream=None, ordered=True)"


def test_constructor_signatures_show_what_they_take():
    # dpctl's order: alignment is the second positional argument
    for cls in (usmipc.memory.MemoryUSMDevice, usmipc.memory.MemoryUSMHost,
                usmipc.memory.MemoryUSMShared):
        assert str(inspect.signature(cls)).startswith(
            "(nbytes, alignment=0, *, device=None"), cls
        assert cls(64, 64, device="host:cpu").nbytes == 64
