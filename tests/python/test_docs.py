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


def test_every_public_name_is_on_an_api_page():
    """The API reference is split by hand (docs/api/*.md, one `::: name`
    per object): a public name of usmipc or usmipc.memory on no page is
    missing from the docs."""
    import pathlib
    import re
    api = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api"
    listed = set()
    for page in api.glob("*.md"):
        listed |= set(re.findall(r"^::: (\S+)$", page.read_text(), re.M))
    missing = []
    for modname, mod in (("usmipc", usmipc), ("usmipc.memory", usmipc.memory)):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if (name.startswith(("USMIPC_E", "__"))
                    or inspect.ismodule(obj)):
                continue  # the codes: errors.md's errorcode; modules: pages
            home = getattr(obj, "__module__", "") or ""
            names = {f"{modname}.{name}", f"usmipc.memory.{name}",
                     f"usmipc.{name}"}
            if not names & listed:
                missing.append(f"{modname}.{name} ({home})")
    assert not missing, f"on no page of docs/api: {missing}"


def test_help_shows_no_inherited_exception_boilerplate():
    """help(usmipc) repeated BaseException's members (__init__, args,
    with_traceback, ...) under every one of its exception classes: 1,411
    lines, about 480 of them that boilerplate (issue 25). The exception
    classes' metaclass lists in dir() what usmipc defines; instances, user
    subclasses, pickling and isinstance checks behave as before."""
    import pickle
    import pydoc
    for mod in (usmipc, usmipc.memory):
        text = pydoc.render_doc(mod, renderer=pydoc.plaintext)
        assert "inherited from builtins" not in text, mod.__name__
        assert "with_traceback" not in text, mod.__name__
    text = pydoc.render_doc(usmipc, renderer=pydoc.plaintext)
    assert text.count("\n") < 1100, text.count("\n")
    assert "native_code = None" in text  # what usmipc defines is still there
    for cls in (usmipc.Error, usmipc.ArgumentError, usmipc.IPCTimeoutError,
                usmipc.SyclDeviceCreationError, usmipc.memory.CopyWarning):
        assert type(cls) is type(usmipc.Error), cls
        assert "with_traceback" not in dir(cls), cls

    class Mine(usmipc.ArgumentError):
        extra = 1
    assert {"code", "name", "native_code", "extra"} <= set(dir(Mine))
    e = Mine("bad")
    assert {"args", "with_traceback", "code"} <= set(dir(e))
    assert isinstance(e, (usmipc.Error, ValueError))
    back = pickle.loads(pickle.dumps(usmipc.ArgumentError("x")))
    assert type(back) is usmipc.ArgumentError and back.args == ("x",)
    try:
        usmipc.Device("nonesuch:gpu")
    except usmipc.SyclDeviceCreationError as x:
        assert x.name == "USMIPC_EINVAL"
    else:
        raise AssertionError("Device('nonesuch:gpu') raised nothing")
