"""The package ships type information (py.typed and the extension's stubs):
mypy --strict passes on the examples and on the README's Python snippets."""
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("mypy")
ROOT = pathlib.Path(__file__).resolve().parents[2]
# The README's snippets are fragments: what they take from the reader's
# program (a tensor, a stream, torch itself, which they do not import) is
# declared first, as Any.
CONTEXT = """\
from typing import Any
import usmipc
from usmipc.memory import IPCMemoryHandle, MemoryUSMDevice
tensor: Any = None
torch_stream: Any = None
torch: Any = None
"""


def test_package_is_typed():
    import usmipc
    pkg = pathlib.Path(usmipc.__file__).parent
    assert (pkg / "py.typed").exists() and (pkg / "_usmipc.pyi").exists()


def test_mypy_strict_on_examples_and_readme(tmp_path):
    files = sorted(str(p) for p in (ROOT / "examples").glob("*.py"))
    readme = (ROOT / "README.md").read_text()
    # Every Python block, run or not (the fence's words after the language
    # say which: tests/python/test_doc_blocks.py).
    blocks = re.findall(r"^```python[^\n]*\n(.*?)^```", readme, re.S | re.M)
    assert len(blocks) >= 2, "the README's Python blocks were not found"
    for i, block in enumerate(blocks):
        snippet = tmp_path / f"readme_{i}.py"
        snippet.write_text(CONTEXT + block)
        files.append(str(snippet))
    # Examples that use torch or mpi4py are checked against them where they
    # are installed; elsewhere (the wheel's fresh environments) the missing
    # modules are taken as Any, and only they.
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n" + "".join(
        f"[mypy-{m}.*]\nignore_missing_imports = True\n"
        f"[mypy-{m}]\nignore_missing_imports = True\n"
        for m in ("torch", "mpi4py") if importlib.util.find_spec(m) is None))
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict",
                        "--config-file", str(config),
                        "--no-incremental", "--cache-dir", str(tmp_path / "c"),
                        *files], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
