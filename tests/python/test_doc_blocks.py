"""Every code block of README.md and docs/ is run, so that the docs cannot rot.

A fence's info string says what becomes of its block; GitHub and the site
(tools/docs/hooks.py strips the words) show only the language:

  ```python test        run here (and in CI), in a new interpreter
  ```python test split  run in two processes: the block is cut at its first
                        line starting with "# ..." (how the docs write "in
                        another process"); the first half runs, hands the
                        names the second half uses to a second interpreter
                        (modules by name, anything else pickled), and stays
                        alive, its exports with it, until the second half
                        has run
  ```c test             a whole program, compiled with -Wall -Wextra -Werror
                        against include/ and the built libusmipc
                        (USMIPC_BUILD_DIR, default build/) and run, under
                        valgrind where it is installed
  ```sh test            run by bash -e in the repository root, `python`
                        being this interpreter
  ```sh ze-test-driver  the same, where the Level Zero loader and the
                        project's test driver (build/tests/level_zero) exist
  ```python gpu-cuda    needs a CUDA GPU (and torch where it imports it):
                        skipped unless USMIPC_DOC_GPU=1, which
                        tests/gpu/doc_blocks.sh sets on the GPU machine
  ```python no-run      a fragment (it uses the reader's own objects) or a
                        command not to run here (the build, apt-get, the
                        GPU run itself); a Python fragment must still
                        compile, and the README's are type-checked
                        (test_typing.py)
  ```text output        right after a block that runs: its exact output

Every python, c and sh fence carries exactly one of test, gpu-cuda,
ze-test-driver and no-run; fences of no language are plain text.
"""
import ast
import builtins
import ctypes.util
import dataclasses
import os
import pathlib
import re
import select
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BUILD = pathlib.Path(os.environ.get("USMIPC_BUILD_DIR", ROOT / "build"))
if not BUILD.is_absolute():
    BUILD = ROOT / BUILD
ZE_DRIVER = ROOT / "build" / "tests" / "level_zero" / \
    "libze_usmipc_test_driver.so"  # the path the blocks name
GPU = os.environ.get("USMIPC_DOC_GPU") == "1"
TIMEOUT = 120  # seconds for any one process

CODE_LANGUAGES = {"python", "c", "sh"}
DECISIONS = {"test", "gpu-cuda", "ze-test-driver", "no-run"}
FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")
SPLIT = re.compile(r"^# \.\.\.")


@dataclasses.dataclass
class Block:
    path: str          # relative to the repository root
    line: int          # of the opening fence, from 1
    language: str
    words: list        # the info string's other words
    code: str
    output: "Block | None" = None

    @property
    def id(self):
        return f"{self.path}:{self.line}"

    @property
    def decision(self):
        found = DECISIONS.intersection(self.words)
        return found.pop() if len(found) == 1 else None


def parse(path):
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2).split()
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            j += 1
        blocks.append(Block(str(path.relative_to(ROOT)), i + 1,
                            info[0] if info else "", info[1:],
                            "\n".join(lines[i + 1:j]) + "\n"))
        i = j + 1
    for prev, block in zip(blocks, blocks[1:]):
        if block.language == "text" and "output" in block.words:
            prev.output = block
    return blocks


BLOCKS = [b for path in DOC_FILES for b in parse(path)]
RUN = [b for b in BLOCKS
       if b.language in CODE_LANGUAGES and b.decision not in (None, "no-run")]
FRAGMENTS = [b for b in BLOCKS
             if b.language == "python" and b.decision == "no-run"]


def test_every_code_fence_has_a_decision():
    problems = []
    for b in BLOCKS:
        if b.language in CODE_LANGUAGES:
            if b.decision is None:
                problems.append(f"{b.id}: ```{b.language} needs one of "
                                f"{sorted(DECISIONS)}, has {b.words}")
            extra = set(b.words) - DECISIONS - {"split"}
            if extra or ("split" in b.words and b.language != "python"):
                problems.append(f"{b.id}: unknown words {b.words}")
            if "split" in b.words and not any(
                    SPLIT.match(line) for line in b.code.splitlines()):
                problems.append(f"{b.id}: split, but no line starts "
                                "with '# ...'")
        elif b.language in ("bash", "shell", "console", "py", "python3"):
            problems.append(f"{b.id}: write ```{b.language} as "
                            "```sh or ```python")
        elif b.words and b.words != ["output"]:
            problems.append(f"{b.id}: unknown words {b.words}")
    for b in BLOCKS:
        if "output" in b.words and not any(
                r.output is b for r in RUN if r.language != "text"):
            problems.append(f"{b.id}: an output block must follow a block "
                            "that runs")
    assert not problems, "\n".join(problems)


def test_blocks_were_found():
    # The extraction itself: a change of the fence syntax must not make
    # every block silently disappear.
    assert len(RUN) >= 8 and len(FRAGMENTS) >= 1, [b.id for b in RUN]
    assert any(b.id.startswith("README.md:") and b.language == "c"
               for b in RUN)


def c_api():
    sys.path.insert(0, str(ROOT / "tools" / "docs"))
    try:
        import c_api
    finally:
        sys.path.pop(0)
    return c_api


def test_every_public_c_call_has_a_doc_block():
    # The site's C API page (tools/docs/c_api.py) is made from the header;
    # its strict build fails on the same list.
    pages, missing = c_api().render()
    assert not missing, "\n".join(missing)
    assert '### `usmipc_ipc_open` {#usmipc_ipc_open' in pages["c-ipc.md"]
    assert "`USMIPC_EEXPORTERGONE`</span> | `-30007` |" in pages["c.md"]
    # Split by topic, every call on exactly one page, and a call named on
    # another page links there (the overview lists them all).
    assert len(pages) == 5 and list(pages)[0] == "c.md"
    _, entries, _ = c_api().entries(c_api().HEADER.read_text())
    for call in (n for e in entries if e.kind == "function" for n in e.names):
        homes = [name for name, page in pages.items()
                 if f"{{#{call} data-toc-label" in page]
        assert len(homes) == 1, (call, homes)
        assert homes[0] == "c.md" or f"({homes[0]}#{call})" in pages["c.md"]
    assert "[`usmipc_ipc_open`](c-ipc.md#usmipc_ipc_open)" in \
        pages["c-bundles.md"] + pages["c-release.md"]


def test_a_call_without_a_doc_block_is_reported():
    header = """/* ---- a section ---- */
/* Documented. */
USMIPC_API int usmipc_a(void);
USMIPC_API int usmipc_b(void);

/* A group's note, then a define and the call it belongs to. */
#define USMIPC_C_FLAG 0x1u
USMIPC_API int usmipc_c(unsigned flags);
/* Not about the next call. */
#define USMIPC_D 1

USMIPC_API int usmipc_d(void);
"""
    _, entries, missing = c_api().entries(header)
    assert [m.split(": ", 1)[1] for m in missing] == [
        "usmipc_b has no doc block directly above it",
        "usmipc_d has no doc block directly above it"]
    c = next(e for e in entries if e.names == ["usmipc_c"])
    assert c.code[0] == "#define USMIPC_C_FLAG 0x1u" and "note" in c.doc


@pytest.mark.parametrize("block", FRAGMENTS, ids=lambda b: b.id)
def test_python_fragment_compiles(block):
    compile("\n" * block.line + block.code, block.path, "exec")


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.id)
def test_block_runs(block, tmp_path):
    if block.decision == "gpu-cuda" and not GPU:
        pytest.skip("needs a CUDA GPU: USMIPC_DOC_GPU=1 "
                    "(bash tests/gpu/doc_blocks.sh on the device machine)")
    if block.decision == "ze-test-driver":
        if ctypes.util.find_library("ze_loader") is None:
            pytest.skip("no Level Zero loader (apt-get install libze1)")
        if not ZE_DRIVER.exists():
            pytest.skip(f"test driver not built at {ZE_DRIVER} (make build)")
    run = {"python": run_python, "c": run_c, "sh": run_sh}[block.language]
    stdout = run(block, tmp_path)
    if block.output is not None:
        got = [line.rstrip() for line in stdout.rstrip("\n").splitlines()]
        want = [line.rstrip()
                for line in block.output.code.rstrip("\n").splitlines()]
        assert got == want, (f"{block.id} printed\n{stdout}\n"
                             f"but {block.output.id} says\n"
                             f"{block.output.code}")


def check(result, block, what="it"):
    assert result.returncode == 0, (
        f"{block.id}: {what} exited with {result.returncode}\n"
        f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result.stdout


# ---- Python -----------------------------------------------------------------

# Runs the code in a file as if it sat at its place in the document (the
# traceback names README.md and its line), with the names a first half of
# the block handed over.
PY_RUN = r"""
import importlib, pickle, sys
code_file, doc, first_line, given = sys.argv[1:5]
g = {"__name__": "__main__"}
if given != "-":
    with open(given, "rb") as f:
        for name, (kind, value) in pickle.load(f).items():
            g[name] = importlib.import_module(value) if kind == "module" else value
with open(code_file) as f:
    code = "\n" * (int(first_line) - 1) + f.read()
exec(compile(code, doc, "exec"), g)
"""

# The first half of a split block: runs, pickles the names the second half
# needs, says so, and keeps its objects (and so its exports) alive until its
# standard input closes.
PY_FIRST = r"""
import os, pickle, sys, types
code_file, doc, first_line, names, out = sys.argv[1:6]
g = {"__name__": "__main__"}
with open(code_file) as f:
    code = "\n" * (int(first_line) - 1) + f.read()
exec(compile(code, doc, "exec"), g)
given = {}
for name in filter(None, names.split(",")):
    if name in g:
        value = g[name]
        given[name] = (("module", value.__name__)
                       if isinstance(value, types.ModuleType)
                       else ("value", value))
with open(out + ".tmp", "wb") as f:
    pickle.dump(given, f)
os.rename(out + ".tmp", out)
print("\0usmipc-doc-ready", flush=True)
sys.stdin.read()
"""
READY = "\0usmipc-doc-ready"


def free_names(code):
    """Names the code reads but never binds (nor are builtins)."""
    loads, stores = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (loads if isinstance(node.ctx, ast.Load) else stores).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            stores.update((a.asname or a.name).split(".")[0]
                          for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            stores.add(node.name)
    return sorted(loads - stores - set(dir(builtins)))


def run_python(block, tmp_path):
    lines = block.code.splitlines(keepends=True)
    if "split" not in block.words:
        code = tmp_path / "block.py"
        code.write_text(block.code)
        return check(subprocess.run(
            [sys.executable, "-c", PY_RUN, str(code), block.path,
             str(block.line + 1), "-"],
            capture_output=True, text=True, timeout=TIMEOUT), block)
    cut = next(i for i, line in enumerate(lines) if SPLIT.match(line))
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text("".join(lines[:cut]))
    second.write_text("".join(lines[cut:]))
    given = tmp_path / "given.pickle"
    producer = subprocess.Popen(
        [sys.executable, "-c", PY_FIRST, str(first), block.path,
         str(block.line + 1), ",".join(free_names(second.read_text())),
         str(given)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        before = []
        while True:
            ready, _, _ = select.select([producer.stdout], [], [], TIMEOUT)
            line = producer.stdout.readline() if ready else ""
            if not line or line.rstrip("\n") == READY:
                break
            before.append(line)
        if not line:
            producer.kill()
            out, err = producer.communicate()
            pytest.fail(f"{block.id}: the first half (its own process) "
                        "ended before handing over its names\nstdout:\n{''.join(before)}{out}\n"
                        f"stderr:\n{err}")
        consumer = subprocess.run(
            [sys.executable, "-c", PY_RUN, str(second), block.path,
             str(block.line + 1 + cut), str(given)],
            capture_output=True, text=True, timeout=TIMEOUT)
        out, err = producer.communicate("", timeout=TIMEOUT)
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()
    check(consumer, block, "the second half (its own process)")
    check(subprocess.CompletedProcess(producer.args, producer.returncode,
                                      out, err),
          block, "the first half, after the second half ran,")
    return "".join(before) + consumer.stdout + out


# ---- C ----------------------------------------------------------------------

def library():
    lib = BUILD / "libusmipc.so"
    if not lib.exists():
        pytest.skip(f"libusmipc not built at {BUILD} (make build, or set "
                    "USMIPC_BUILD_DIR)")
    return lib


def run_c(block, tmp_path):
    library()
    source, exe = tmp_path / "block.c", tmp_path / "block"
    # Compiler messages name the document and its line.
    source.write_text(f'#line {block.line + 1} "{block.path}"\n{block.code}')
    cc = os.environ.get("CC", "cc")
    check(subprocess.run(
        [cc, "-std=c11", "-Wall", "-Wextra", "-Werror", "-g",
         f"-I{ROOT / 'include'}", str(source), "-o", str(exe),
         f"-L{BUILD}", "-lusmipc", f"-Wl,-rpath,{BUILD}"],
        capture_output=True, text=True, timeout=TIMEOUT), block,
        "compiling it")
    command = [str(exe)]
    if shutil.which("valgrind") and os.environ.get("USMIPC_DOC_VALGRIND",
                                                   "1") != "0":
        # A read of freed memory (the README's sample once read the handle
        # bytes after usmipc_ipc_free_handle) exits 99 with the report.
        command = ["valgrind", "-q", "--error-exitcode=99",
                   "--leak-check=no", *command]
    return check(subprocess.run(command, capture_output=True, text=True,
                                timeout=TIMEOUT), block)


# ---- shell ------------------------------------------------------------------

def run_sh(block, tmp_path):
    if block.decision == "ze-test-driver" or "build/" in block.code:
        library()
    shims = tmp_path / "bin"  # `python` is this interpreter
    shims.mkdir()
    for name in ("python", "python3"):  # a script: a venv's symlink moved
        (shims / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (shims / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{shims}{os.pathsep}{os.environ['PATH']}")
    return check(subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.code], cwd=ROOT,
        env=env, capture_output=True, text=True, timeout=TIMEOUT), block)
